# SPDX-License-Identifier: Apache-2.0
"""Each GPU target's memory facts agree with the device-facts file its compiler reads.

The planner and the compile tests take a chip's memory and bandwidth from `tpu_platform.planner.targets`;
XLA's GPU compiler takes them from the `GpuTargetConfigProto` text in `device_facts/`. Read
without the CUDA plugin: the fields are plain `name: value` lines.
"""

from __future__ import annotations

import re

import pytest

from tpu_platform.planner.targets import TARGETS, device_facts

GPU_TARGETS = [t for t in TARGETS.values() if t.platform == "cuda"]


def _field(text: str, name: str) -> float:
    match = re.search(rf"^\s*{name}:\s*([0-9.]+)\s*$", text, re.MULTILINE)
    assert match, f"no {name} in the device facts"
    return float(match.group(1))


@pytest.mark.parametrize("target", GPU_TARGETS, ids=[t.name for t in GPU_TARGETS])
def test_target_matches_its_device_facts(target):
    facts = device_facts(target.device_facts)
    assert _field(facts, "device_memory_size") == target.hbm_bytes
    assert _field(facts, "memory_bandwidth") == pytest.approx(target.hbm_bytes_per_second, rel=1e-3)
    assert 'platform_name: "CUDA"' in facts
    assert _field(facts, "major") >= 8  # the Triton kernel's floor: compute capability 8.0


def test_every_gpu_kind_has_a_one_gpu_target():
    assert {t.chip for t in GPU_TARGETS} == {"h100", "h200", "a100", "l4"}
    assert all(f"{chip}x1" in TARGETS for chip in ("h100", "h200", "a100", "l4"))
