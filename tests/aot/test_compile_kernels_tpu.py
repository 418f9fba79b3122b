# SPDX-License-Identifier: Apache-2.0
"""The Mosaic TPU kernel and its KV write, compiled by libtpu's real TPU compiler.

One worker process (`tests.aot.compile_kernels tpu`) compiles a layer step, KV write then
ragged attention, for every case of kernel_cases on v5e and v6e chips (the realistic cases
also on v5p and v4): Mosaic checks the kernel's layouts, DMA shapes and scoped-VMEM budget,
and XLA's TPU passes lay out the cache both ops share. Each case then asserts on its own
result (kernel_checks). `make test` compiles one point a class (`kernel_cases.in_full_only`):
the grid's points no realistic case stands for, on v5e, and each realistic case on one of v5e and
v6e; the rest are `make test-full`'s, compiled by a worker of their own.
"""

from __future__ import annotations

import pytest

from tests.aot.kernel_cases import in_full_only, plan
from tests.aot.kernel_checks import check_compiled, compile_plan, plan_params

PLAN = plan("tpu")


@pytest.fixture(scope="module")
def results() -> dict:
    return compile_plan("tpu", PLAN, full_only=False)


@pytest.fixture(scope="module")
def full_results() -> dict:
    return compile_plan("tpu", PLAN, full_only=True)


@pytest.mark.parametrize(("target", "case"), plan_params(PLAN))
def test_compiles_and_fits(request, target, case):
    fixture = "full_results" if in_full_only(target, case) else "results"
    check_compiled(request.getfixturevalue(fixture), target, case)
