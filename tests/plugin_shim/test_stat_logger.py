# SPDX-License-Identifier: Apache-2.0
"""The stat logger plugin exports the counters the worker publishes (cross-process file)."""

import contextlib
import logging
import types

from prometheus_client import REGISTRY

from plugin_shim.stat_logger import XlaStatLogger
from tpu_platform.envs import read_env
from tpu_platform.metrics_file import MetricsPublisher, metrics_path, read_metrics


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
