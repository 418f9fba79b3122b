# SPDX-License-Identifier: Apache-2.0
"""The Gated DeltaNet ops compile with the real GPU and TPU compilers at Qwen3-Next-80B-A3B's
per-layer shape (`tests.aot.gated_delta_compile`), update both state pools in place, and need no
temp memory that grows with the pools: a step's scratch is its own sequences' states and chunks.
On the GPU also a verification under speculative decoding, each request writing a state after
each of its 1 + 4 rows into its 5 slots: no copy of a pool there either (a pool threaded through
the chunk loop's carry and a conditional was copied whole, twice a layer, before).

The TPU compiler takes minutes on each of these programs (XLA's form of the chunked rule, longer
the more rows), so the TPU runs only the decode step: in `make test` of 16 sequences (what grows
with the pools shows at any batch), in `make test-full` of 128."""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

# A step's sequences' states in and out (128 x 2 MiB each way for the decode step) and the
# prefill's chunks; well under what one layer's weights take.
TEMP_LIMIT = 600 << 20


@pytest.mark.parametrize(
    ("platform", "target", "rows"),
    [
        ("cuda", "h100x1", ()),
        ("tpu", "v6e-1", ("16",)),
        pytest.param("tpu", "v6e-1", ("128",), marks=pytest.mark.full),
    ],
)
def test_gated_delta_ops_compile_in_place_without_pool_sized_temporaries(platform, target, rows):
    cases = run_worker(platform, "gated_delta_compile", target, *rows, timeout=1800)
    for case in cases:
        assert "error" not in case, f"{target} {case['case']}: {case.get('error')}"
        assert case["in_place"], f"{target} {case['case']}: the pools are not aliased in -> out"
        assert case["temp_bytes"] < TEMP_LIMIT, case
    # Per step shape, the pools' sizes; temp memory may move by bytes (TPU's scatters add ~1 KiB a
    # slot: under a thousandth of a slot's 2 MiB), never by slots' worth.
    for small, large in zip(cases[::2], cases[1::2], strict=True):
        assert small["rows"] == large["rows"]
        growth = large["temp_bytes"] - small["temp_bytes"]
        assert growth < (large["pool_bytes"] - small["pool_bytes"]) / 1000, (small, large)
