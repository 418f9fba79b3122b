# SPDX-License-Identifier: Apache-2.0
"""The private internals of `plugin_shim.internals` taken away (public fallback, one warning), and
the vLLM version check at activation."""

import functools
import logging
import os
import sys
import types

import jax
import pytest
from prometheus_client import CollectorRegistry, Gauge

import plugin_shim
from plugin_shim import devices, stat_logger, versions
from plugin_shim.internals import jax_backends_initialized
from plugin_shim.platform import _engine_start_method
from tpu_platform import internals
from tpu_platform.metrics_file import MetricsPublisher, metrics_path


@pytest.fixture(autouse=True)
def _fresh_warnings():
    internals.warn_fallback.cache_clear()
    yield
    internals.warn_fallback.cache_clear()


def _warnings_naming(caplog, text: str) -> int:
    return sum(r.levelno == logging.WARNING and text in r.getMessage() for r in caplog.records)


def test_without_backends_are_initialized_an_imported_jax_counts_as_running(monkeypatch, caplog):
    jax.devices()
    bridge = sys.modules["jax._src.xla_bridge"]
    monkeypatch.setitem(sys.modules, "jax._src.xla_bridge", types.SimpleNamespace())  # lacks it
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    with caplog.at_level(logging.WARNING):
        assert jax_backends_initialized() and jax_backends_initialized()
        _engine_start_method()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # the safe choice when unsure
    assert _warnings_naming(caplog, "backends_are_initialized") == 1
    monkeypatch.setitem(sys.modules, "jax._src.xla_bridge", bridge)
    assert jax_backends_initialized()  # with the internal: the real answer
    monkeypatch.delitem(sys.modules, "jax._src.xla_bridge")
    assert not jax_backends_initialized()  # JAX not imported: no backend, no warning needed
    assert _warnings_naming(caplog, "backends_are_initialized") == 1


def test_without_the_registry_map_two_engines_share_the_gauges(monkeypatch, caplog, tmp_path):
    """Two engines in one process register the same gauge names; without prometheus_client's
    `_names_to_collectors` the gauges made earlier in the process are reused."""
    registry = CollectorRegistry()
    monkeypatch.setattr(stat_logger, "REGISTRY", types.SimpleNamespace())  # lacks the map
    monkeypatch.setattr(stat_logger, "Gauge", functools.partial(Gauge, registry=registry))
    stat_logger._gauge.cache_clear()
    monkeypatch.setenv("VLLM_XLA_CACHE_DIR", str(tmp_path))
    config = types.SimpleNamespace(
        instance_id="internals", model_config=types.SimpleNamespace(served_model_name="tiny")
    )
    snapshot = {
        "compiles": 3.0, "programs_loaded": 1.0, "compile_seconds": 2.0, "compiles_after_warmup": 0.0,
        "steps": 10.0, "host_seconds": 0.5, "dispatch_seconds": 0.1, "step_seconds": 1.0,
        "overlapped_steps": 0.0,
    }  # fmt: skip
    with caplog.at_level(logging.WARNING):
        for engine in (0, 1):
            logger = stat_logger.XlaStatLogger(config, engine_index=engine)
            MetricsPublisher(metrics_path(str(tmp_path), "internals", engine)).publish(
                {**snapshot, "steps": 10.0 * (engine + 1)}, force=True
            )
            logger.record(None, None)
    stat_logger._gauge.cache_clear()
    for engine in (0, 1):
        labels = {"model_name": "tiny", "engine": str(engine)}
        assert registry.get_sample_value("vllm_xla:steps", labels) == 10.0 * (engine + 1)
        assert registry.get_sample_value("vllm_xla:compilations", labels) == 3.0
    assert _warnings_naming(caplog, "_names_to_collectors") == 1


@pytest.mark.parametrize(
    ("version", "tested"),
    [("0.32.0", True), ("0.32.3", True), ("0.32.1+cpu", True), ("0.32.1.dev3", True),
     ("0.31.2", False), ("0.33.0", False), ("1.0.0", False), ("not-a-version", False)],
)  # fmt: skip
def test_tested_vllm_range(version, tested):
    assert versions.is_tested(version) is tested


def test_an_untested_vllm_is_named_once_and_still_activates(monkeypatch, caplog):
    log = logging.getLogger("test.versions")
    with caplog.at_level(logging.WARNING, logger="test.versions"):
        assert versions.vllm_usable("0.32.0", log)
        assert not caplog.records  # tested: nothing to say
        assert versions.vllm_usable("0.40.1", log)
    [record] = caplog.records
    assert "0.40.1" in record.getMessage() and ">=0.32.0,<0.33" in record.getMessage()
    monkeypatch.setenv("VLLM_XLA_PLATFORM", "cpu")
    monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.40.1")
    assert plugin_shim.register() == plugin_shim.PLATFORM_CLASS


def test_a_vllm_without_the_plugins_interfaces_leaves_it_inactive(monkeypatch, caplog):
    assert versions.missing_vllm_names() == []  # the installed vLLM has them all
    required = (*versions.REQUIRED_VLLM_NAMES, ("vllm.v1.worker.worker_base", "NoSuchBase"))
    monkeypatch.setattr(versions, "REQUIRED_VLLM_NAMES", required)
    assert versions.missing_vllm_names() == ["vllm.v1.worker.worker_base.NoSuchBase"]
    log = logging.getLogger("test.versions")
    with caplog.at_level(logging.WARNING, logger="test.versions"):
        assert versions.vllm_usable("0.32.0", log)  # in the tested range: not checked again
        assert not versions.vllm_usable("0.40.1", log)
    [record] = caplog.records
    assert record.levelno == logging.ERROR and "NoSuchBase" in record.getMessage()
    monkeypatch.setenv("VLLM_XLA_PLATFORM", "cpu")
    monkeypatch.setattr(devices, "detect_tpu", lambda: False)
    monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.40.1")
    assert plugin_shim.register() is None
