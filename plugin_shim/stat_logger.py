# SPDX-License-Identifier: Apache-2.0
"""`vllm.stat_logger_plugins` entry: our runner's counters beside vLLM's metrics.

The worker publishes its counters (compilations and their seconds, steps, host and device time
per step) to `<VLLM_XLA_CACHE_DIR>/metrics/<instance>-<engine>.json`; this logger, which vLLM's
API server creates for every engine, reads them on each `record` and exports them as Prometheus
gauges (`vllm_xla:*` on `/metrics`) and in the periodic log line. It does nothing when the
engine does not run on our platform.
"""

from __future__ import annotations

import functools
import time

from prometheus_client import REGISTRY, Gauge
from vllm.logger import init_logger
from vllm.v1.metrics.loggers import StatLoggerBase

from plugin_shim.internals import registered_collector
from tpu_platform.envs import read_env
from tpu_platform.metrics_file import EXPERT_TOKENS, MetricsFileError, metrics_path, read_metrics

logger = init_logger("vllm.xla.stats")

# Gauge name -> (help, how it is computed from a snapshot).
GAUGES = {
    "vllm_xla:compilations": (
        "XLA programs built, compiled or loaded (warm-up included)",
        lambda s, d: s["compiles"],
    ),
    "vllm_xla:programs_loaded": (
        "XLA programs loaded from the executable cache instead of compiled",
        lambda s, d: s["programs_loaded"],
    ),
    "vllm_xla:compile_seconds": (
        "Seconds spent building XLA programs (compiling or loading)",
        lambda s, d: s["compile_seconds"],
    ),
    "vllm_xla:compilations_after_warmup": (
        "XLA programs compiled after warm-up (0 when every shape was warmed up)",
        lambda s, d: s["compiles_after_warmup"],
    ),
    "vllm_xla:steps": ("Engine steps the runner executed", lambda s, d: s["steps"]),
    "vllm_xla:host_seconds_per_step": (
        "Mean host time per step (inputs in to dispatch, plus output), since the last report",
        lambda s, d: _per_step(d, "host_seconds"),
    ),
    "vllm_xla:dispatch_seconds_per_step": (
        "Of the host time per step, the runtime's part: input transfer and execute calls, since "
        "the last report",
        lambda s, d: _per_step(d, "dispatch_seconds"),
    ),
    "vllm_xla:step_seconds_per_step": (
        "Mean time per step from dispatch to sampled tokens on the host, since the last report "
        "(under async scheduling this includes the wait behind the previous step)",
        lambda s, d: _per_step(d, "step_seconds"),
    ),
    "vllm_xla:overlapped_step_fraction": (
        "Share of steps dispatched before the previous step's tokens reached the host (async "
        "scheduling: the tokens go from step to step on the device), since the last report",
        lambda s, d: _per_step(d, "overlapped_steps"),
    ),
    "vllm_xla:spec_decode_acceptance_rate": (
        "Share of the draft tokens verified that were kept (speculative decoding), since the last "
        "report; 0 without drafts",
        lambda s, d: d.get("accepted_tokens", 0.0) / d["draft_tokens"] if d.get("draft_tokens") else 0.0,
    ),
}


# What the gauges and the log line read from a snapshot.
SNAPSHOT_KEYS = frozenset(
    {"steps", "overlapped_steps", "host_seconds", "dispatch_seconds", "step_seconds", "compiles"}
    | {"programs_loaded", "compile_seconds", "compiles_after_warmup"}
)


def _per_step(delta: dict[str, float], name: str) -> float:
    return delta[name] / delta["steps"] if delta["steps"] > 0 else 0.0


def _delta(current: dict[str, float], previous: dict[str, float] | None) -> dict[str, float]:
    """Counter increments since `previous` (everything, when there is none)."""
    previous = previous or {}
    return {k: v - previous.get(k, 0.0) for k, v in current.items()}


EXPERT_GAUGE = "vllm_xla:expert_tokens_per_step"
EXPERT_HELP = (
    "Tokens routed to each expert per step (summed over the MoE layers; label `expert`: the "
    "expert's index), mean since the last report; a mixture-of-experts model's only"
)


def _expert_loads(snapshot: dict[str, float], delta: dict[str, float]) -> dict[str, float]:
    """Expert index -> tokens routed to it per step since the last report."""
    names = [name for name in snapshot if name.startswith(EXPERT_TOKENS)]
    return {name[len(EXPERT_TOKENS) :]: _per_step(delta, name) for name in names}


@functools.cache  # one per process: a second engine in it shares the gauges (label `engine`)
def _gauge(name: str, documentation: str, extra_labels: tuple[str, ...] = ()) -> Gauge:
    existing = registered_collector(REGISTRY, name)  # registered by an earlier copy of this module
    if existing is not None:
        return existing
    return Gauge(name, documentation, labelnames=["model_name", "engine", *extra_labels])


class XlaStatLogger(StatLoggerBase):
    """Exports the runner's counters; a no-op on any other platform."""

    def __init__(self, vllm_config, engine_index: int = 0):
        from vllm.platforms import current_platform

        from plugin_shim.platform import XlaPlatform

        self.active = isinstance(current_platform, XlaPlatform)
        self.path = metrics_path(read_env().cache_dir, vllm_config.instance_id, engine_index)
        self.labels = {
            "model_name": str(vllm_config.model_config.served_model_name),
            "engine": str(engine_index),
        }
        self.gauges = {name: _gauge(name, doc) for name, (doc, _) in GAUGES.items()} if self.active else {}
        self.snapshot: dict[str, float] | None = None
        self._reported: dict[str, float] | None = None
        self._read_at = float("-inf")
        self._skipped: str | None = None  # why the last read was skipped

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if not self.active or time.monotonic() - self._read_at < 1.0:
            return
        self._read_at = time.monotonic()
        snapshot = self._read()
        if snapshot is None or snapshot == self.snapshot:
            return
        delta = _delta(snapshot, self.snapshot)
        self.snapshot = snapshot
        for name, (_, compute) in GAUGES.items():
            self.gauges[name].labels(**self.labels).set(compute(snapshot, delta))
        loads = _expert_loads(snapshot, delta)
        if loads:
            gauge = _gauge(EXPERT_GAUGE, EXPERT_HELP, ("expert",))
            for expert, tokens in loads.items():
                gauge.labels(**self.labels, expert=expert).set(tokens)

    def _read(self) -> dict[str, float] | None:
        """The published snapshot; None when there is none or it is not one of ours (said once
        per kind of problem: the server carries on, the gauges keep their last values)."""
        try:
            snapshot = read_metrics(self.path)
        except MetricsFileError as error:
            self._skip(str(error))
            return None
        missing = sorted(SNAPSHOT_KEYS - snapshot.keys()) if snapshot is not None else []
        if missing:
            self._skip(f"{self.path} is not a vllm-xla counter snapshot (no {', '.join(missing)})")
            return None
        self._skipped = None
        return snapshot

    def _skip(self, reason: str) -> None:
        if reason != self._skipped:
            logger.warning("vllm-xla: skipping the runner's counters: %s", reason)
        self._skipped = reason

    def log(self) -> None:
        if not self.active or self.snapshot is None or self.snapshot == self._reported:
            return
        delta = _delta(self.snapshot, self._reported)
        self._reported = self.snapshot
        logger.info(
            "vllm-xla: %d steps (%.0f%% overlapped), host %.2f ms/step (%.2f of it runtime calls), "
            "step %.1f ms/step; %d programs built in %.1f s (%d from the executable cache, %d after "
            "warm-up)",
            delta["steps"], 100 * _per_step(delta, "overlapped_steps"),
            1e3 * _per_step(delta, "host_seconds"), 1e3 * _per_step(delta, "dispatch_seconds"),
            1e3 * _per_step(delta, "step_seconds"),
            self.snapshot["compiles"], self.snapshot["compile_seconds"],
            self.snapshot["programs_loaded"], self.snapshot["compiles_after_warmup"],
        )  # fmt: skip

    def log_engine_initialized(self) -> None:
        return None
