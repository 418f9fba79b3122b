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
from tests.aot.mla_compile import plan
from tests.aot.toolchains import run_worker

TPU_PLAN = plan("tpu")


@pytest.fixture(scope="module")
def tpu_results() -> dict:
    return run_worker("tpu", "mla_compile", "tpu")


@pytest.mark.parametrize(("target", "case"), TPU_PLAN, ids=[f"{t}-{c.name}" for t, c in TPU_PLAN])
def test_tpu_compiles_and_fits(tpu_results, target, case):
    check_compiled(tpu_results, target, case)


GPU_PLAN = plan("cuda")


@pytest.fixture(scope="module")
def gpu_results() -> dict:
    return run_worker("cuda", "mla_compile", "cuda")


@pytest.mark.parametrize(("target", "case"), GPU_PLAN, ids=[f"{t}-{c.name}" for t, c in GPU_PLAN])
def test_gpu_compiles_and_fits(gpu_results, target, case):
    check_compiled(gpu_results, target, case)
