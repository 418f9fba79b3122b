# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/_report.format_runner_stats`: the overlap of async scheduling is reported only for an
engine that ran it; an engine with it off (the CPU default) says so, whether the report recorded
the setting or predates it (read from the run's environment)."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

report = load_benchmark("_report", register=True)  # its dataclasses look their module up by name


def _results(**recorded) -> dict:
    before = {"steps": 10, "host_seconds": 0.0, "overlapped_steps": 0, "sampler_steps": 0}
    after = {"steps": 30, "host_seconds": 0.02, "overlapped_steps": 15, "sampler_steps": 4,
             "compiles_after_warmup": 0}  # fmt: skip
    ours = {"status": "ok", "runner_stats_after_startup": before, "runner_stats": after, **recorded}
    return {"batch": {"xla": ours}}


@pytest.mark.parametrize(
    ("recorded", "overlaps"),
    [
        ({"async_scheduling": True}, True),
        ({"async_scheduling": False}, False),
        ({"env": {"VLLM_XLA_PLATFORM": "cpu"}}, False),  # a report from before the setting was kept
        ({"env": {"VLLM_XLA_PLATFORM": "cpu", "VLLM_XLA_CPU_ASYNC_SCHEDULING": "1"}}, True),
        ({"env": {"VLLM_XLA_PLATFORM": "tpu"}}, True),
    ],
)
def test_overlap_is_reported_only_where_async_scheduling_ran(recorded, overlaps):
    line = report.format_runner_stats(_results(**recorded))
    assert line.startswith("ours, batch: 20 steps, host 1.00 ms/step, ")
    assert ("75% dispatched while the previous step ran" in line) == overlaps
    assert ("async scheduling off" in line) == (not overlaps)
    assert line.endswith("4 sampler runs, 0 compiles after warm-up")


def _single(peers: dict[str, float]) -> dict:
    return {"single": {p: {"status": "ok", "tok_s": v} for p, v in peers.items()}}


def test_our_own_peers_are_reported_beside_ours_only_where_they_ran():
    both = _single({"xla": 150.0, "xla-int8": 120.0, "xla-bf16": 60.0, "vllm-cpu": 50.0})
    row = report.ratios(both)["single tok/s"]
    assert row["xla/vllm-cpu"] == pytest.approx(3.0)
    assert row["xla-int8/xla"] == pytest.approx(0.8)
    assert row["xla/xla-bf16"] == pytest.approx(2.5)  # the model as it ships against its float weights
    header = report.format_table(both).splitlines()[0].split()
    assert header[-3:] == ["int8/ours", "ours/bf16", "better"]
    alone = _single({"xla": 150.0, "vllm-cpu": 50.0})
    assert report.ratios(alone)["single tok/s"]["xla/xla-bf16"] is None
    assert "bfloat16" not in report.format_table(alone) and "bf16" not in report.format_table(alone)
