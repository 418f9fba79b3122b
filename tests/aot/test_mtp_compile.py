# SPDX-License-Identifier: Apache-2.0
"""The MTP layer of a DeepSeek-V3-shaped target compiles with the real GPU (H100) compiler
(`tests.aot.mtp_compile`): its pass over a prefill step and its k = 4 loop, at DeepSeek-V3's full
width (latent attention, 256 routed experts). The pass and the loop update the layer's latent
cache in place and make no temporary of its size. (One chip: MTP is served without tensor
parallelism, and an H100 holds the layer's weights.)"""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

pytestmark = pytest.mark.full  # DeepSeek-V3's MoE layer at full width: minutes of compiling

D, V, EXPERTS, MOE, Q_RANK, LATENT, ROPE, HEADS = 7168, 129280, 256, 2048, 1536, 512, 64, 128
# The layer: eh_proj, the shared head and the embedding's copy, latent attention, the router,
# 256 routed experts and one shared one.
MTP_PARAMETERS = (
    2 * D * D
    + 2 * V * D
    + D * Q_RANK + Q_RANK * HEADS * (128 + ROPE)
    + D * (LATENT + ROPE) + LATENT * HEADS * (128 + 128) + HEADS * 128 * D
    + D * EXPERTS
    + (EXPERTS + 1) * 3 * D * MOE
)  # fmt: skip


def test_the_mtp_layers_programs_compile_for_h100():
    out = run_worker("cuda", "mtp_compile", "h100x1")
    for name in ("head_pass", "head_loop"):
        assert "error" not in out[name], f"h100x1 {name}: {out[name].get('error')}"
    cache = out["head_cache_bytes"]
    for name in ("head_pass", "head_loop"):
        assert out[name]["alias_bytes"] >= cache, f"{name} does not update the layer's cache in place"
        assert out[name]["temp_bytes"] < cache, f"a cache-sized temporary in {name}"
    assert out["head_weight_bytes"] == pytest.approx(2 * MTP_PARAMETERS, rel=0.02)  # bfloat16
