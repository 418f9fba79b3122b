# SPDX-License-Identifier: Apache-2.0
"""A hybrid model's verification step under speculative decoding compiles with the real GPU (H100)
and TPU (v6e-1) compilers (`tests.aot.hybrid_verify_compile`): Qwen3-Next-80B-A3B at full width,
cut to layers alternating Gated DeltaNet and gated full attention, 4 requests verifying k = 4
drafts each, every request holding 1 + k state blocks (a state after each verified row). The
state pools and KV pages are updated in place (all of them aliased in -> out), no instruction
makes an array as large as the smallest of them (no copy of a pool), and the step's temporaries
do not grow with the pools: its scratch is its own requests' states.

All of it in `make test-full` (a whole step's compile takes a minute on the GPU and minutes on the
TPU): the H100 and v6e-1 points with dense MLPs (one layer of each kind), and the H100 with two
layers of each kind and the model's 512 routed experts and shared one. (Not on v6e-1: there the
MoE layer's own temporaries for a 20-row step, over 2 GB, outweigh the pools that fit beside its
weights, so no pool-sized buffer could be told from them.) The cheap points in `make test`: the
Gated DeltaNet ops' verification on H100 (`test_gated_delta_compile.py`) and the planner's
hybrid verification program equal to the runner's (`test_plan_hybrid.py`). With an EAGLE-3 head
(its three layers an output of the step, its pass and loop compiled beside it) on the H100 and
v6e-1 too."""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

K = 4
ROWS = 4
# Two pool sizes: what grows with them shows between the two; at the larger, every cache array is
# larger than any of the step's own buffers, so one as large as the smallest is a cache's copy.
PAGES = (128, 2048)

pytestmark = [pytest.mark.full, pytest.mark.timeout(3600)]


@pytest.mark.parametrize(
    ("platform", "target", "layers", "mlp"),
    [("cuda", "h100x1", 2, "dense"), ("tpu", "v6e-1", 2, "dense"), ("cuda", "h100x1", 4, "moe")],
    ids=["h100-dense", "v6e-dense", "h100-moe"],
)  # fmt: skip
def test_the_verify_step_keeps_1_plus_k_states_in_place(platform, target, layers, mlp):
    cases = run_worker(
        platform, "hybrid_verify_compile", target, str(layers), mlp, str(K),
        *(f"{ROWS}:{pages}" for pages in PAGES), timeout=3000,
    )  # fmt: skip
    for case in cases:
        assert case["state_columns"] == 1 + K and case["state_groups"] == 1, case  # one of the state layers
        assert case["shape"][:2] == [ROWS * (1 + K), ROWS], case  # 1 + k rows a request
        assert case["alias_bytes"] >= case["cache_bytes"], f"{case['case']}: caches not updated in place"
        assert case["temp_bytes"] < case["largest_pool_bytes"], case
    small, large = cases
    assert large["large_buffers"] == [], large["case"]
    growth = large["temp_bytes"] - small["temp_bytes"]
    assert growth < (large["cache_bytes"] - small["cache_bytes"]) / 1000, (small, large)


@pytest.mark.parametrize(("platform", "target"), [("cuda", "h100x1"), ("tpu", "v6e-1")], ids=["h100", "v6e"])
def test_the_verify_step_hands_an_eagle3_head_its_layers_and_the_heads_programs_compile(platform, target):
    """The same step (one layer of each kind, dense MLPs, 2048 block ids) with an EAGLE-3 head's
    three layers as an output (`tests.aot.hybrid_eagle3_compile`: a Gated DeltaNet layer's input
    and output, the attention layer's output), then the head's pass over that step, its tables
    the full-attention group's, and its loop: every cache updated in place, no temporary of a
    cache's size."""
    out = run_worker(platform, "hybrid_eagle3_compile", target, *map(str, (K, ROWS, PAGES[1])), timeout=3000)
    assert out["state_columns"] == 1 + K
    assert out["step"]["alias_bytes"] >= out["cache_bytes"], "the step's caches not updated in place"
    assert out["large_buffers"] == []
    cache = out["head_cache_bytes"]
    for name in ("head_pass", "head_loop"):
        assert out[name]["alias_bytes"] >= cache, f"{name} does not update the head's cache in place"
        assert out[name]["temp_bytes"] < cache, f"a cache-sized temporary in {name}"
