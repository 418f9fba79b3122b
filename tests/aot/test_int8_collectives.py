# SPDX-License-Identifier: Apache-2.0
"""Under tensor parallelism a row-parallel int8 projection's all-reduce carries bfloat16, as a
bfloat16 weight's does, not its float32 partial products (`int8_collectives_worker`): the TPU
compiler's optimized program, for one per-channel and one grouped (Q8_0-like) layout."""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker


@pytest.mark.parametrize("target", ["v6e-8"])
def test_row_parallel_int8_all_reduces_carry_bfloat16(target):
    types = run_worker("tpu", "int8_collectives_worker", target, timeout=600)
    assert types["bfloat16"] == ["bf16"]  # the reference: one all-reduce, in the weights' dtype
    assert types["int8"] == ["bf16"]
    assert types["int8-g32"] == ["bf16"]
