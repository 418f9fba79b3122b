# SPDX-License-Identifier: Apache-2.0
"""Per-case assertions on a compile worker's answer (tests.aot.compile_kernels)."""

from __future__ import annotations

import pytest

from tests.aot.kernel_cases import CompileCase, in_full_only
from tests.aot.toolchains import run_worker
from tpu_platform.planner.targets import target as compile_target

LARGE_CACHE_BYTES = 256 << 20


def plan_params(plan: list[tuple[str, CompileCase]]) -> list:
    """The plan's (target, case) pairs as test parameters, the ones outside `make test`'s points
    (`kernel_cases.in_full_only`) marked `full`."""
    return [
        pytest.param(t, c, id=f"{t}-{c.name}", marks=[pytest.mark.full] if in_full_only(t, c) else [])
        for t, c in plan
    ]


def compile_plan(platform: str, plan: list[tuple[str, CompileCase]], *, full_only: bool) -> dict:
    """One compile worker's answers for the plan's `make test` points (or, `full_only`, the rest)."""
    pairs = [f"{t}/{c.name}" for t, c in plan if in_full_only(t, c) == full_only]
    return run_worker(platform, "compile_kernels", platform, *pairs)


def footprint(result: dict) -> int:
    """Bytes the compiled program holds on the chip at its peak: arguments, outputs that do not
    reuse a donated argument, and temporaries."""
    return result["argument_bytes"] + result["output_bytes"] - result["alias_bytes"] + result["temp_bytes"]


def check_compiled(results: dict, target: str, case: CompileCase) -> None:
    """The case compiled for `target` with its kernel inside and fits the chip's memory, or (an
    `expect_error` case) the compiler refused it for the reason named."""
    result = results[f"{target}/{case.name}"]
    if case.expect_error:
        assert not result["ok"], f"{target} compiled {case.name}, whose tuning must overflow"
        assert case.expect_error.lower() in result["error"].lower(), result["error"]
        return
    assert result["ok"], f"{target} refused {case.name}: {result['error']}"
    assert result["kernel_call"], f"the compiled program for {target} lost its Pallas kernel call"
    hbm = compile_target(target).hbm_bytes
    assert footprint(result) <= hbm, f"{footprint(result)} bytes do not fit {target}'s {hbm}"
    # The write and the kernel agree on the cache's layout: no temporary copy of the whole cache
    # (told apart from the step's other temporaries once the cache is large: the realistic cases).
    if result["cache_bytes"] < LARGE_CACHE_BYTES:
        return
    assert result["temp_bytes"] < result["cache_bytes"], (
        f"temp {result['temp_bytes']} bytes >= the {result['cache_bytes']}-byte KV cache: the compiled "
        "layer converts the cache between layouts"
    )
