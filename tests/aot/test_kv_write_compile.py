# SPDX-License-Identifier: Apache-2.0
"""The Mosaic TPU KV write compiles with the real TPU compiler for each TPU generation, updates the
cache in place and needs no temp memory of the cache's size (`tests.aot.kv_write_compile`)."""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker


# The whole grid where the cache is served (v5e, v6e); its first two cases (bf16 decode, float8)
# for the other generations, which only adds compile time (`make test-full`: the same kernel
# and cases as v5e's and v6e's, for another chip).
@pytest.mark.parametrize(
    ("target", "cases"),
    [
        ("v5e-1", ()),
        ("v6e-1", ()),
        pytest.param("v5p-8", ("2",), marks=pytest.mark.full),
        pytest.param("v4-8", ("2",), marks=pytest.mark.full),
    ],
)
def test_kv_write_compiles(target, cases):
    for case in run_worker("tpu", "kv_write_compile", target, *cases):
        assert "error" not in case, f"{target} {case['case']}: {case.get('error')}"
        assert case["in_place"], f"{target} {case['case']}: the cache is not aliased in -> out"
        assert case["temp_bytes"] < case["cache_bytes"], case
