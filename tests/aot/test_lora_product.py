# SPDX-License-Identifier: Apache-2.0
"""A projection carrying LoRA slots compiles for a v6e chip and an H100 (`lora_product_worker`)
with temporaries well under its weight at a few tokens, and at a prefill's 2048 tokens within a
few copies of its `[T, out]` float32 output: no per-token copy of adapter weights (`[T, in, r]`,
`[T, r, out]`, 16 outputs' bytes here) and no `[T, slots, out]` product (4)."""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker


@pytest.mark.parametrize("platform, target", [("tpu", "v6e-1"), ("cuda", "h100x1")])
def test_lora_projection_temporaries_stay_small(platform, target):
    got = run_worker(platform, "lora_product_worker", target, "8,64,512,2048", timeout=900)
    for tokens in ("8", "64", "512"):
        assert got[tokens]["per_weight"] < 0.75, (tokens, got)
    assert got["2048"]["per_output"] < 3, got
