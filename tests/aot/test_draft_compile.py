# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding's programs compile with the real TPU (v6e-1) and GPU (H100) compilers: the
verification of k = 4 drafts for Llama-3.1-8B (the verify step, the step program at its own shape
with the head on every row, cut to the draft's layer count; the random rows' program; the
programs from hidden states; the rows' program with penalties, bad words, min_tokens, biases and
allowed ids per position) and the draft loop of a Llama-3.2-1B draft
(`tests.aot.draft_compile`). The loop updates the draft's caches in place and makes no temporary of
their size; the draft's planner rows are its published size. `make test` compiles for the H100 (the
v6e-1's in `make test-full`) the loop with the draft's first 2 layers at full width, its caches as
large as the whole draft's (what the loop does to its caches, it does layer by layer); `make
test-full` all 16."""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

LLAMA_32_1B_PARAMETERS = 1.24e9  # the model card's count (tied embedding counted once)


@pytest.mark.parametrize(
    ("platform", "target", "draft_layers"),
    # The TPU's are `make test-full`'s: the class (caches updated in place, no temporary of their
    # size) is checked on TPU by test_step_kv_copies.py, the draft loop's own on the H100.
    [pytest.param("tpu", "v6e-1", 2, marks=pytest.mark.full), ("cuda", "h100x1", 2)]
    + [pytest.param(p, t, 16, marks=pytest.mark.full) for p, t in (("tpu", "v6e-1"), ("cuda", "h100x1"))],
)
def test_verify_and_draft_loop_compile(platform, target, draft_layers):
    out = run_worker(platform, "draft_compile", target, str(draft_layers))
    assert out["draft_layers"] == draft_layers
    names = ("verify_step", "verify_rows_random", "verify_rows_options", "verify_greedy", "verify_random")
    for name in (*names, "draft_loop"):
        assert "error" not in out[name], f"{target} {name}: {out[name].get('error')}"
    # The verify step: 64 requests of 1 + 4 rows, a shape of its own; its caches updated in place.
    assert out["verify_step_shape"][:2] == [320, 64]
    step, step_cache = out["verify_step"], out["verify_step_cache_bytes"]
    assert step["alias_bytes"] >= step_cache, f"{target}: the verify step's caches are not updated in place"
    assert step["temp_bytes"] < step_cache, f"{target}: a cache-sized temporary in the verify step"
    loop, cache = out["draft_loop"], out["draft_cache_bytes"]
    assert loop["alias_bytes"] >= cache, f"{target}: the draft's caches are not updated in place"
    assert loop["temp_bytes"] < cache, f"{target}: a cache-sized temporary in the draft loop"
    # bfloat16, and the tied head served from its own copy (`models.prepare_for_serving`).
    head_copy = 2048 * 128256
    weights = out["draft_memory"]["weight_bytes"]
    assert weights == pytest.approx(2 * (LLAMA_32_1B_PARAMETERS + head_copy), rel=0.01)
    # Llama-3.2-1B: 16 layers of 8 KV heads of 64 against Llama-3.1-8B's 32 of 8 of 128 (a
    # backend may pad the draft's rows to 128 lanes): at most half the target's page.
    assert 0 < out["draft_memory"]["page_bytes"] * 2 <= out["target_page_bytes"]
