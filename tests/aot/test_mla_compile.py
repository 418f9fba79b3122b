# SPDX-License-Identifier: Apache-2.0
"""The latent attention (MLA) kernels and their latent writes, compiled by the real compilers:
libtpu's for v5e and v6e (Mosaic checks the kernel's layouts, DMA shapes and scoped-VMEM
budget), XLA's GPU compiler for an H100 (Triton lowers the kernel against the GPU's facts).

One worker process per platform (`tests.aot.mla_compile`) compiles a layer step, write then
attention, for DeepSeek-V3's widths (latent 512, rope 64; 128 heads, or a chip's 16 at TP=8)
at the runner's page sizes over 4k-32k contexts, and for the interpret-mode grid's shapes.
Each case then asserts (kernel_checks) that its kernel is in the program, that it fits the
chip, and, for the large caches, that no temporary is the size of the cache (the write and the
kernel agree on the cache's layout, so the step never converts it).
"""

from __future__ import annotations

import pytest

from tests.aot.kernel_checks import check_compiled
from tests.aot.mla_compile import REALISTIC, V5E_REALISTIC_IN_MAKE_TEST, in_full_only, plan
from tests.aot.toolchains import run_worker

TPU_PLAN = plan("tpu")


def _tpu_results(full_only: bool) -> dict:
    pairs = [f"{t}/{c.name}" for t, c in TPU_PLAN if in_full_only(t, c) == full_only]
    return run_worker("tpu", "mla_compile", "tpu", *pairs)


@pytest.fixture(scope="module")
def tpu_results() -> dict:
    return _tpu_results(full_only=False)


@pytest.fixture(scope="module")
def tpu_full_results() -> dict:
    return _tpu_results(full_only=True)


@pytest.mark.parametrize(
    ("target", "case"),
    [
        pytest.param(t, c, id=f"{t}-{c.name}", marks=[pytest.mark.full] if in_full_only(t, c) else [])
        for t, c in TPU_PLAN
    ],
)
def test_tpu_compiles_and_fits(request, target, case):
    fixture = "tpu_full_results" if in_full_only(target, case) else "tpu_results"
    check_compiled(request.getfixturevalue(fixture), target, case)


def test_make_test_compiles_every_tpu_case_once():
    """Each case on one chip at least, and the names `make test` keeps on v5e are cases."""
    assert V5E_REALISTIC_IN_MAKE_TEST <= {c.name for c in REALISTIC}
    kept = {c.name for t, c in TPU_PLAN if not in_full_only(t, c)}
    assert kept == {c.name for _, c in TPU_PLAN}


GPU_PLAN = plan("cuda")


@pytest.fixture(scope="module")
def gpu_results() -> dict:
    return run_worker("cuda", "mla_compile", "cuda")


@pytest.mark.parametrize(("target", "case"), GPU_PLAN, ids=[f"{t}-{c.name}" for t, c in GPU_PLAN])
def test_gpu_compiles_and_fits(gpu_results, target, case):
    check_compiled(gpu_results, target, case)
