# SPDX-License-Identifier: Apache-2.0
"""The Mosaic TPU kernel and its KV write, compiled by libtpu's real TPU compiler.

One worker process (`tests.aot.compile_kernels tpu`) compiles a layer step, KV write then
ragged attention, for every case of kernel_cases on v5e and v6e chips (the realistic cases
also on v5p and v4): Mosaic checks the kernel's layouts, DMA shapes and scoped-VMEM budget,
and XLA's TPU passes lay out the cache both ops share. Each case then asserts on its own
result (kernel_checks).
"""

from __future__ import annotations

import pytest

from tests.aot.kernel_cases import plan
from tests.aot.kernel_checks import check_compiled
from tests.aot.toolchains import run_worker

PLAN = plan("tpu")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_worker("tpu", "compile_kernels", "tpu")


@pytest.mark.parametrize(("target", "case"), PLAN, ids=[f"{t}-{c.name}" for t, c in PLAN])
def test_compiles_and_fits(results, target, case):
    check_compiled(results, target, case)
