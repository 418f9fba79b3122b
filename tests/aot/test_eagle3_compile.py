# SPDX-License-Identifier: Apache-2.0
"""An EAGLE-3 head's programs compile with the real TPU (v6e-1) and GPU (H100) compilers
(`tests.aot.eagle3_compile`): the target's step with the head's hidden states as an output, the
head's pass over a prefill step and its k = 4 loop, for Llama-3.1-8B's shapes. The pass and the
loop update the head's cache in place and make no temporary of its size. So do an EAGLE-1
head's (`tests.aot.eagle_compile`; the target's step is its plain one).

The prefill step is 512 tokens on the H100 (in `make test`); on v6e-1 (`make test-full`) a
128-token one, whose programs the TPU compiler takes well under the time of the 512-token ones
(its query rows, more than the loop's 64 rows, still make it a prefill's program), and the 512."""

from __future__ import annotations

import pytest

from tests.aot.eagle3_compile import NUM_PAGES
from tests.aot.toolchains import run_worker

# The head of Llama-3.1-8B: one layer (2 * 4096 into q/k/v), fc 3 * 4096 -> 4096, its own
# embedding of 128256 rows, an LM head of 32000, d2t.
HEAD_PARAMETERS = (
    2 * 4096 * (4096 + 2 * 1024)
    + 4096 * 4096
    + 3 * 4096 * 14336
    + 3 * 4096 * 4096
    + 128256 * 4096
    + 32000 * 4096
)


@pytest.mark.parametrize(
    ("platform", "target", "prefill"),
    [
        # `make test-full`'s: the head's programs' class (a cache updated in place, no temporary
        # of its size) is checked on TPU by test_step_kv_copies.py, the head's own on the H100.
        pytest.param("tpu", "v6e-1", 128, marks=pytest.mark.full),
        pytest.param("tpu", "v6e-1", 512, marks=pytest.mark.full),
        ("cuda", "h100x1", 512),
    ],
)
def test_the_target_step_and_the_heads_programs_compile(platform, target, prefill):
    out = run_worker(platform, "eagle3_compile", target, "1", str(prefill))
    for name in ("target_step", "head_pass", "head_loop"):
        assert "error" not in out[name], f"{target} {name}: {out[name].get('error')}"
    cache = out["head_cache_bytes"]
    for name in ("head_pass", "head_loop"):
        assert out[name]["alias_bytes"] >= cache, (
            f"{target}: {name} does not update the head's cache in place"
        )
        assert out[name]["temp_bytes"] < cache, f"{target}: a cache-sized temporary in {name}"
    # bfloat16 weights (and the RoPE table): the head's published size.
    assert out["head_weight_bytes"] == pytest.approx(2 * HEAD_PARAMETERS, rel=0.02)


@pytest.mark.full  # Llama-3.1-8B's head on a v6e-8 mesh: the TPU compiler for eight chips
def test_the_heads_programs_compile_split_over_a_v6e_8():
    out = run_worker("tpu", "eagle3_compile", "v6e-8", "8")
    assert out["tp_size"] == 8
    for name in ("target_step", "head_pass", "head_loop"):
        assert "error" not in out[name], f"v6e-8 {name}: {out[name].get('error')}"
    cache = out["head_cache_bytes"]  # a chip's share: one of the head's 8 KV heads
    for name in ("head_pass", "head_loop"):
        assert out[name]["alias_bytes"] >= cache, f"v6e-8: {name} does not update the head's cache in place"
        assert out[name]["temp_bytes"] < cache, f"v6e-8: a cache-sized temporary in {name}"
    # Split by the rules table but fc (3 * 4096 x 4096) and the norms, whole on each chip.
    whole = 3 * 4096 * 4096
    assert out["head_weight_bytes"] == pytest.approx(2 * ((HEAD_PARAMETERS - whole) / 8 + whole), rel=0.02)
    # The planner's rows for the head beside the target are a chip's share too.
    assert out["planned"]["weight_bytes"] == pytest.approx(out["head_weight_bytes"], rel=0.02)
    assert out["planned"]["page_bytes"] * NUM_PAGES == cache


# EAGLE-1's head of Llama-3.1-8B: one layer (4096 into q/k/v), fc 2 * 4096 -> 4096, and copies of
# the target's embedding and LM head (128256 rows each; the runner shares the target's own).
EAGLE_HEAD_PARAMETERS = (
    4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096 * 4096 + 2 * 128256 * 4096
)


@pytest.mark.parametrize(
    ("platform", "target"),
    [pytest.param("tpu", "v6e-1", marks=pytest.mark.full), ("cuda", "h100x1")],  # TPU: 45 s on 2 cores
)
def test_an_eagle_heads_programs_compile(platform, target):
    out = run_worker(platform, "eagle_compile", target, "1", "512")
    cache = out["head_cache_bytes"]
    for name in ("head_pass", "head_loop"):
        assert "error" not in out[name], f"{target} {name}: {out[name].get('error')}"
        assert out[name]["alias_bytes"] >= cache, (
            f"{target}: {name} does not update the head's cache in place"
        )
        assert out[name]["temp_bytes"] < cache, f"{target}: a cache-sized temporary in {name}"
    assert out["head_weight_bytes"] == pytest.approx(2 * EAGLE_HEAD_PARAMETERS, rel=0.02)
