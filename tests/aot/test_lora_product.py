# SPDX-License-Identifier: Apache-2.0
"""A projection carrying LoRA slots compiles for an H100 (and a v6e chip, `make test-full`)
(`lora_product_worker`) with temporaries well under its weight at a few tokens, and at a prefill's
2048 tokens within a few copies of its `[T, out]` float32 output: no per-token copy of adapter
weights (`[T, in, r]`, `[T, r, out]`, 16 outputs' bytes here) and no `[T, slots, out]` product (4);
on a mesh, the slot arrays split like their projections compile without gathering any of them."""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker


# The TPU's compiles are `make test-full`'s: the same program's temporaries (the class a per-token
# copy of adapter weights belongs to) are checked on the H100, and what the TPU compiler makes of
# a wider copy of a weight on test_int8_step.py's v5e step.
@pytest.mark.parametrize(
    "platform, target", [pytest.param("tpu", "v6e-1", marks=pytest.mark.full), ("cuda", "h100x1")]
)
def test_lora_projection_temporaries_stay_small(platform, target):
    got = run_worker(platform, "lora_product_worker", target, "8,64,512,2048", timeout=900)
    for tokens in ("8", "64", "512"):
        assert got[tokens]["per_weight"] < 0.75, (tokens, got)
    assert got["2048"]["per_output"] < 3, got


# On v6e-4 in `make test-full`: the H100s' compile checks the same sharding rules' collectives.
@pytest.mark.parametrize(
    "platform, target", [pytest.param("tpu", "v6e-4", marks=pytest.mark.full), ("cuda", "h100x8")]
)
def test_lora_slots_split_like_their_projection_need_no_gather(platform, target):
    """Under tensor parallelism (`models.sharding`'s rules), a column-parallel projection's
    update needs no collective at all (each device its own B columns); a row-parallel one's sums
    its rank-sized `x @ A` partials besides the projection's own all-reduce. No slot array is
    gathered."""
    got = run_worker(platform, "lora_product_worker", target, "64", timeout=900)
    assert got["mlp.gate_up_proj"] == [], got
    ops = got["self_attn.o_proj"]
    assert {op for op, _ in ops} == {"all-reduce"}, got
    shapes = sorted(shape.split("[")[1].rstrip("]") for _, shape in ops)
    assert len(shapes) == 2 and shapes[1] == "64,4096" and shapes[0].endswith(",32"), got  # rank 2 x 16
