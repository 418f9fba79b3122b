# SPDX-License-Identifier: Apache-2.0
"""A mixture of experts' prefill step holds no temporary the size of its experts.

GPT-OSS-120B's step (128 mxfp4 experts, top-4, hidden 2880) with its first two layers at full
width is compiled at TP=8 for v6e-8 by the real TPU compiler (`moe_step_worker`, a 2k-token
prefill chunk). The routed matmul multiplies each tile of rows by its own expert's kernels: a
prefill has about three times as many tiles as experts, and gathering (and decoding) every
tile's kernels at once took a few times the whole stack's bytes a layer, which no KV cache size
then left room for. The tiles now run in chunks (`models.moe.tile_chunks`): the step's
temporaries stay under one layer's experts dequantized to bfloat16, whatever the token count.
"""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

CASE = "v6e-8:gpt-oss-120b:8:2:2048"  # target:model:TP:layers:tokens


@pytest.fixture(scope="module")
def step() -> dict:
    return run_worker("tpu", "moe_step_worker", CASE, timeout=3500)[0]


def test_prefill_temporaries_stay_under_one_layers_experts(step):
    assert step["moe_layers"] == 2
    # One chip's share of a layer: 128 experts' gate/up (2 x 384 of 2880) and down, mxfp4.
    assert step["layer_expert_dequantized_bytes"] == 2 * 128 * 2880 * (768 + 384)
    assert step["layer_expert_bytes"] == 128 * 2880 * (768 + 384) * 17 // 32
    assert step["temp_bytes"] < step["layer_expert_dequantized_bytes"], step["largest_buffers"]
