# SPDX-License-Identifier: Apache-2.0
"""The Pallas GPU (Triton) kernel and its KV write, compiled by XLA's real GPU compiler.

One worker process (`tests.aot.compile_kernels cuda`) compiles a layer step, KV write then
ragged attention, for every case of kernel_cases on H100, A100 and L4 compile-only devices:
Triton lowers the kernel to PTX against the GPU's facts (`tpu_platform/planner/device_facts/`), so a
tile that needs more shared memory than the GPU has, or an operation its compute capability
lacks, fails here. Each case then asserts on its own result (kernel_checks).
"""

from __future__ import annotations

import pytest

from tests.aot.kernel_cases import plan
from tests.aot.kernel_checks import check_compiled
from tests.aot.toolchains import run_worker

PLAN = plan("cuda")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_worker("cuda", "compile_kernels", "cuda")


@pytest.mark.parametrize(("target", "case"), PLAN, ids=[f"{t}-{c.name}" for t, c in PLAN])
def test_compiles_and_fits(results, target, case):
    check_compiled(results, target, case)


def test_a100_cannot_compile_a_float8_e4m3fn_cache():
    """Triton converts float8_e4m3fn only from compute capability 8.9 (L4, H100): for an A100
    the compiler aborts its process. Serving an fp8 (e4m3) cache on an A100 needs the kernel to
    widen the bytes itself; until then A100s serve bfloat16 or float8_e5m2 caches. When this
    test fails, the A100 compiles it: move its fp8 cases back into the plan."""
    with pytest.raises(AssertionError, match="only supported on compute capability >= 89"):
        run_worker("cuda", "compile_kernels", "cuda", "a100x1/grid_decode_p32_d128_g4_fp8")
