# SPDX-License-Identifier: Apache-2.0
"""A mixture of experts' prefill step holds no temporary the size of its experts.

GPT-OSS-120B's step (128 mxfp4 experts, top-4, hidden 2880) with its first two layers at full
width is compiled at TP=8 for v6e-8 by the real TPU compiler (`moe_step_worker`: a 512-token
and a 2k-token prefill chunk, both in `make test-full`). The routed matmul multiplies
each tile of rows by its own expert's kernels: a prefill has about three times as many tiles as
experts (at 512 tokens as at 2k: the tiles hold fewer rows), and gathering (and decoding) every
tile's kernels at once took a few times the whole stack's bytes a layer, which no KV cache size
then left room for. The tiles now run in chunks (`models.moe.tile_chunks`): the step's
temporaries stay under one layer's experts dequantized to bfloat16, whatever the token count.

GLM-4.5-Air's prefill at TP=4 on 8x H100 (128 experts, top-8, hidden 4096) at its first 2 and 4
layers: XLA's GPU compiler allocated the chunk loop's `[tiles, rows, hidden]` buffers (every
tile's gathered rows, and its outputs stacked by the loop) for every MoE layer of the step at
once, about a fifth of a GiB more temporaries a layer (10 GiB over its 46 layers). Each chunk
now gathers its own rows and adds its outputs to the tokens' rows inside the loop: what a layer
adds stays well under one such buffer.
"""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

CASE = "v6e-8:gpt-oss-120b:8:2:{tokens}"  # target:model:TP:layers:tokens
# The TPU compiler's time grows with the prefill's rows; the chunk loop is the same at either count.
# Both are `make test-full`'s: the chunking is `models.moe`'s on either compiler, and the GPU's
# check below fails as this one would if every tile's kernels were gathered at once (a few
# stacks' bytes a layer against less than one tile buffer).
TOKENS = [pytest.param(512, marks=pytest.mark.full), pytest.param(2048, marks=pytest.mark.full)]
GPU_DEPTHS = ("h100x8:glm-4.5-air:4:2:2048", "h100x8:glm-4.5-air:4:4:2048")


@pytest.fixture(scope="module", params=TOKENS, ids=lambda tokens: f"{tokens}-tokens")
def step(request) -> dict:
    return run_worker("tpu", "moe_step_worker", CASE.format(tokens=request.param), timeout=3500)[0]


def test_prefill_temporaries_stay_under_one_layers_experts(step):
    from models.moe import num_tiles, tile_rows

    assert step["moe_layers"] == 2
    # Enough tiles that every tile's kernels gathered at once would take over twice the bound.
    assignments, experts = int(step["case"].split(":")[-1]) * 4, 128
    assert num_tiles(assignments, experts, tile_rows(assignments, experts)) > 2 * experts
    # One chip's share of a layer: 128 experts' gate/up (2 x 384 of 2880) and down, mxfp4.
    assert step["layer_expert_dequantized_bytes"] == 2 * 128 * 2880 * (768 + 384)
    assert step["layer_expert_bytes"] == 128 * 2880 * (768 + 384) * 17 // 32
    assert step["temp_bytes"] < step["layer_expert_dequantized_bytes"], step["largest_buffers"]


@pytest.fixture(scope="module")
def gpu_depths() -> list[dict]:
    return run_worker("cuda", "moe_step_worker", *GPU_DEPTHS, timeout=3500)


def test_gpu_prefill_temporaries_grow_by_less_than_a_tile_buffer_a_layer(gpu_depths):
    from models.moe import num_tiles, tile_rows

    shallow, deep = gpu_depths
    assert (shallow["moe_layers"], deep["moe_layers"]) == (1, 3)  # the first layer is dense
    assignments, experts, hidden = 2048 * 8, 128, 4096
    rows = tile_rows(assignments, experts)
    tile_buffer = num_tiles(assignments, experts, rows) * rows * hidden * 2  # bfloat16, ~191 MiB
    per_layer = (deep["temp_bytes"] - shallow["temp_bytes"]) / 2
    assert per_layer < tile_buffer / 2, (per_layer, tile_buffer, deep["largest_buffers"])
