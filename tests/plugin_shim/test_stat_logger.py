# SPDX-License-Identifier: Apache-2.0
"""The stat logger plugin exports the counters the worker publishes (cross-process file)."""

import contextlib
import errno
import json
import logging
import os
import types

import numpy as np
import pytest
from prometheus_client import REGISTRY

from plugin_shim.stat_logger import EXPERT_GAUGE, XlaStatLogger
from tpu_platform.envs import read_env
from tpu_platform.metrics_file import (
    MAX_SNAPSHOT_BYTES,
    MetricsFileError,
    MetricsPublisher,
    expert_token_counts,
    metrics_path,
    read_metrics,
)

_PUBLISHER_LOG = "vllm_xla.tpu_platform.metrics_file"


def _snapshot(steps: int, host: float, step: float, overlapped: int = 0) -> dict[str, float]:
    return {
        "steps": steps,
        "overlapped_steps": overlapped,
        "host_seconds": host,
        "dispatch_seconds": host / 4,
        "step_seconds": step,
        "compiles": 12,
        "programs_loaded": 9,
        "compile_seconds": 30.5,
        "compiles_after_warmup": 0,
    }


def _value(name: str, engine: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": "tiny", "engine": engine})


def test_publisher_writes_at_most_once_per_interval(tmp_path):
    publisher = MetricsPublisher(str(tmp_path / "m" / "x.json"), interval=3600)
    assert read_metrics(publisher.path) is None
    assert publisher.publish({"steps": 1})
    assert not publisher.publish({"steps": 2})  # inside the interval: skipped
    assert read_metrics(publisher.path) == {"steps": 1}
    assert publisher.publish({"steps": 3}, force=True)
    assert read_metrics(publisher.path) == {"steps": 3}
    publisher.remove()
    assert read_metrics(publisher.path) is None


def test_logger_exports_per_step_means_between_reports(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_XLA_CACHE_DIR", str(tmp_path))
    config = types.SimpleNamespace(
        instance_id="test-instance", model_config=types.SimpleNamespace(served_model_name="tiny")
    )
    stat_logger = XlaStatLogger(config, engine_index=7)
    assert stat_logger.active  # the tests run on our platform
    publisher = MetricsPublisher(metrics_path(read_env().cache_dir, "test-instance", 7))
    publisher.publish(_snapshot(steps=10, host=0.010, step=1.0, overlapped=8), force=True)
    stat_logger.record(None, None)
    assert _value("vllm_xla:steps", "7") == 10
    assert _value("vllm_xla:compilations", "7") == 12
    assert _value("vllm_xla:programs_loaded", "7") == 9
    assert _value("vllm_xla:compile_seconds", "7") == 30.5
    assert _value("vllm_xla:compilations_after_warmup", "7") == 0
    assert abs(_value("vllm_xla:host_seconds_per_step", "7") - 0.001) < 1e-12
    assert abs(_value("vllm_xla:dispatch_seconds_per_step", "7") - 0.00025) < 1e-12
    assert abs(_value("vllm_xla:step_seconds_per_step", "7") - 0.1) < 1e-12
    assert abs(_value("vllm_xla:overlapped_step_fraction", "7") - 0.8) < 1e-12

    publisher.publish(_snapshot(steps=30, host=0.050, step=3.0, overlapped=26), force=True)
    stat_logger._read_at = float("-inf")  # skip the one-second read throttle
    stat_logger.record(None, None)
    assert _value("vllm_xla:steps", "7") == 30
    assert abs(_value("vllm_xla:host_seconds_per_step", "7") - 0.002) < 1e-12  # (0.05 - 0.01) / 20
    assert abs(_value("vllm_xla:dispatch_seconds_per_step", "7") - 0.0005) < 1e-12
    assert abs(_value("vllm_xla:step_seconds_per_step", "7") - 0.1) < 1e-12
    assert abs(_value("vllm_xla:overlapped_step_fraction", "7") - 0.9) < 1e-12  # (26 - 8) / 20

    with _log_lines("vllm.xla.stats") as lines:
        stat_logger.log()  # the first report: everything up to now
        stat_logger.log()  # nothing new since: no line
        publisher.publish(_snapshot(steps=40, host=0.070, step=4.5, overlapped=36), force=True)
        stat_logger._read_at = float("-inf")
        stat_logger.record(None, None)
        stat_logger.log()  # the 10 steps since the first report
    assert lines == [
        "vllm-xla: 30 steps (87% overlapped), host 1.67 ms/step (0.42 of it runtime calls), "
        "step 100.0 ms/step; 12 programs built in 30.5 s (9 from the executable cache, 0 after warm-up)",
        "vllm-xla: 10 steps (100% overlapped), host 2.00 ms/step (0.50 of it runtime calls), "
        "step 150.0 ms/step; 12 programs built in 30.5 s (9 from the executable cache, 0 after warm-up)",
    ]


def test_logger_exports_tokens_per_expert_per_step(monkeypatch, tmp_path):
    """A MoE model's snapshot holds each expert's routed tokens since start (`expert_tokens.<e>`,
    summed over the layers, `expert_token_counts`): exported per expert as a mean per step."""
    monkeypatch.setenv("VLLM_XLA_CACHE_DIR", str(tmp_path))
    config = types.SimpleNamespace(
        instance_id="test-instance", model_config=types.SimpleNamespace(served_model_name="tiny")
    )
    stat_logger = XlaStatLogger(config, engine_index=8)
    publisher = MetricsPublisher(metrics_path(read_env().cache_dir, "test-instance", 8))
    first = np.array([[4, 0, 2], [1, 3, 2]])  # [L, E] since start
    publisher.publish({**_snapshot(steps=2, host=0.0, step=0.0), **expert_token_counts(first)}, force=True)
    stat_logger.record(None, None)
    then = np.array([[10, 6, 2], [7, 3, 4]])  # 4 steps later
    publisher.publish({**_snapshot(steps=6, host=0.0, step=0.0), **expert_token_counts(then)}, force=True)
    stat_logger._read_at = float("-inf")
    stat_logger.record(None, None)
    labels = {"model_name": "tiny", "engine": "8"}
    got = [REGISTRY.get_sample_value(EXPERT_GAUGE, {**labels, "expert": str(e)}) for e in range(3)]
    assert got == [(17 - 5) / 4, (9 - 3) / 4, (6 - 4) / 4]
    assert expert_token_counts(None) == {}  # a dense model publishes none


def test_publisher_logs_a_failing_target_once_and_carries_on(tmp_path):
    """A directory where the snapshot goes makes every write fail (as a read-only or full disk
    would); publishing returns False, logs the first failure only, and recovers."""
    publisher = MetricsPublisher(str(tmp_path / "m" / "x.json"), interval=0.0)
    os.makedirs(publisher.path)
    with _log_lines(_PUBLISHER_LOG) as lines:
        assert not publisher.publish({"steps": 1})
        assert not publisher.publish({"steps": 2})
        assert not publisher.publish({"steps": 3}, force=True)
        os.rmdir(publisher.path)
        assert publisher.publish({"steps": 4})
    assert publisher.failed_writes == 3
    assert len(lines) == 2 and "cannot publish the runner's counters" in lines[0], lines
    assert "again" in lines[1]
    assert read_metrics(publisher.path) == {"steps": 4}
    assert os.listdir(tmp_path / "m") == ["x.json"]  # no staging file left behind


def test_publisher_survives_a_full_disk_and_a_parent_that_is_a_file(tmp_path, monkeypatch):
    publisher = MetricsPublisher(str(tmp_path / "x.json"), interval=0.0)

    def disk_full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with _log_lines(_PUBLISHER_LOG) as lines:
        with monkeypatch.context() as patch:
            patch.setattr(os, "replace", disk_full)
            assert not publisher.publish({"steps": 1})
            assert not publisher.publish({"steps": 2})
        (tmp_path / "file").write_text("")
        under_a_file = MetricsPublisher(str(tmp_path / "file" / "metrics" / "x.json"))
        assert not under_a_file.publish({"steps": 1})
    assert sum("No space left on device" in line for line in lines) == 1
    assert sum("file/metrics/x.json" in line for line in lines) == 1
    assert sorted(os.listdir(tmp_path)) == ["file"]  # the staging file went with the failed write


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b'{"steps": 1, "compi', "is not JSON"),  # truncated
        (b"not json at all", "is not JSON"),
        (b"\xff\xfe\x00garbage", "is not JSON"),
        (b"[" * 20_000, "is not JSON"),  # nested beyond the parser's recursion limit
        (b"[1, 2]", "holds a JSON list"),
        (b'"steps"', "holds a JSON str"),
        (b'{"steps": "many", "compiles": 1}', "not finite numbers: ['steps']"),
        (b'{"steps": NaN}', "not finite numbers: ['steps']"),
        (b'{"steps": true}', "not finite numbers: ['steps']"),
        (b" " * (MAX_SNAPSHOT_BYTES + 1), "larger than a counter snapshot"),
    ],
)
def test_read_refuses_what_is_not_a_snapshot(tmp_path, content, problem):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(MetricsFileError, match=r"x\.json") as raised:
        read_metrics(str(path))
    assert problem in str(raised.value)


def test_read_refuses_an_unreadable_path(tmp_path):
    os.makedirs(tmp_path / "x.json")
    with pytest.raises(MetricsFileError, match="cannot read"):
        read_metrics(str(tmp_path / "x.json"))


def test_logger_skips_foreign_and_malformed_files_saying_why_once(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_XLA_CACHE_DIR", str(tmp_path))
    config = types.SimpleNamespace(
        instance_id="foreign", model_config=types.SimpleNamespace(served_model_name="tiny")
    )
    stat_logger = XlaStatLogger(config, engine_index=8)
    path = metrics_path(str(tmp_path), "foreign", 8)
    os.makedirs(os.path.dirname(path))

    def record(content: str) -> None:
        with open(path, "w") as f:
            f.write(content)
        stat_logger._read_at = float("-inf")  # skip the one-second read throttle
        stat_logger.record(None, None)

    with _log_lines("vllm.xla.stats") as lines:
        record(json.dumps({"requests": 3}))  # another program's JSON
        record(json.dumps({"requests": 4}))  # the same problem: said once
        record('{"steps": 1')  # a torn file
        stat_logger.log()  # nothing read: no report
        record(json.dumps(_snapshot(steps=5, host=0.01, step=0.5)))
        stat_logger.log()
    assert len(lines) == 3, lines
    assert "is not a vllm-xla counter snapshot (no " in lines[0] and "steps" in lines[0]
    assert "is not JSON" in lines[1]
    assert lines[2].startswith("vllm-xla: 5 steps")
    assert _value("vllm_xla:steps", "8") == 5


@contextlib.contextmanager
def _log_lines(name: str):
    """The formatted messages `name`'s logger emits (vLLM's loggers do not propagate)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_logger_exports_the_draft_acceptance_rate_between_reports(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_XLA_CACHE_DIR", str(tmp_path))
    config = types.SimpleNamespace(
        instance_id="spec-instance", model_config=types.SimpleNamespace(served_model_name="tiny")
    )
    stat_logger = XlaStatLogger(config, engine_index=8)
    publisher = MetricsPublisher(metrics_path(read_env().cache_dir, "spec-instance", 8))
    publisher.publish(_snapshot(steps=10, host=0.01, step=1.0, overlapped=0), force=True)
    stat_logger.record(None, None)
    assert _value("vllm_xla:spec_decode_acceptance_rate", "8") == 0.0  # no speculation: no drafts
    spec = dict(draft_tokens=40, accepted_tokens=30)
    publisher.publish({**_snapshot(steps=20, host=0.02, step=2.0, overlapped=0), **spec}, force=True)
    stat_logger._read_at = float("-inf")
    stat_logger.record(None, None)
    assert _value("vllm_xla:spec_decode_acceptance_rate", "8") == 0.75
    spec = dict(draft_tokens=60, accepted_tokens=35)
    publisher.publish({**_snapshot(steps=30, host=0.03, step=3.0, overlapped=0), **spec}, force=True)
    stat_logger._read_at = float("-inf")
    stat_logger.record(None, None)
    assert _value("vllm_xla:spec_decode_acceptance_rate", "8") == 0.25  # (35 - 30) / (60 - 40)
