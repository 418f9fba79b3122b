# SPDX-License-Identifier: Apache-2.0
"""Qwen3-Next-80B-A3B's step at TP=8, by the real compilers (`full`: each target's compile takes
many minutes on two cores): its first four layers at full width (three Gated DeltaNet layers and
a gated full-attention one, 512 experts and a shared one in each) on one v6e host (8 chips) and
on 8x H100, through the planner as the runner would serve it (`tensor_parallel_worker full`):
state pools beside KV pages, pages raised until one holds a layer's state
(`tpu_platform.planner.hybrid`).

Each step fits with room for at least one whole sequence, updates the donated caches (state pools
and KV pages) in place, holds no temporary the size of one layer's recurrent pool, and exchanges
only what the rules table implies.

And a Qwen3.5 dense shape on one v6e chip (`model_step_worker full`): transformers' default
`Qwen3_5TextConfig` (width 4096, 16 query and 4 KV heads of 256, 16 key and 32 value heads of
128 in the Gated DeltaNet layers, its four input projections, a 248k vocabulary), its first four
layers, under the same checks but the collectives (one chip).
"""

from __future__ import annotations

import json
from importlib import resources

import pytest

from tests.aot.model_step_worker import MAX_MODEL_LEN
from tests.aot.toolchains import run_worker

pytestmark = [pytest.mark.full, pytest.mark.timeout(3600)]

LAYERS = 4  # layers 0-2 Gated DeltaNet, 3 full attention
TP = 8
# One chip's share of one request's recurrent state in one layer: 32 value heads of 128 x 128
# float32, over 8 chips.
RECURRENT_BYTES = 32 // TP * 128 * 128 * 4


@pytest.fixture(scope="module", params=[("tpu", "v6e-8"), ("cuda", "h100x8")], ids=["v6e-8", "h100x8"])
def row(request, tmp_path_factory) -> dict:
    platform, target = request.param
    shipped = resources.files("tpu_platform.planner").joinpath("model_configs", "qwen3-next-80b-a3b.json")
    config = json.loads(shipped.read_text())
    config.update(num_hidden_layers=LAYERS)
    path = tmp_path_factory.mktemp("qwen3_next_80b") / "config.json"
    path.write_text(json.dumps(config))
    return run_worker(platform, "tensor_parallel_worker", "full", f"{target}:{path}:{TP}", timeout=3500)[0]


def test_step_fits_with_the_caches_in_place_and_no_pool_sized_temporaries(row):
    assert row["fits"], row["reason"]
    assert row["tp_size"] == TP and row["kv_tokens"] >= MAX_MODEL_LEN
    total = row["total_weight_bytes"]
    assert total / TP <= row["weight_bytes"] <= total / TP + row["replicated_weight_bytes"]
    one_pool = row["num_pages"] * RECURRENT_BYTES  # one layer's recurrent pool on one chip
    for step in ("decode", "prefill"):
        program = row[step]
        assert program["peak_bytes"] <= row["budget_bytes"] <= row["hbm_bytes"]
        assert program["alias_bytes"] >= row["kv_bytes"]  # state pools and KV pages updated in place
        assert program["temp_bytes"] < one_pool, (step, program["temp_bytes"], one_pool)


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_step_exchanges_what_the_rules_table_implies(row, step):
    assert row["unexpected_collectives"][step] == []


QWEN35_DENSE = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True,
    },
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
}  # fmt: skip


@pytest.fixture(scope="module")
def dense_row(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("qwen35_dense") / "config.json"
    path.write_text(json.dumps(QWEN35_DENSE))
    return run_worker("tpu", "model_step_worker", "full", f"v6e-1:{path}", timeout=3500)[0]


def test_qwen35_dense_step_fits_one_v6e_chip_with_the_caches_in_place(dense_row):
    assert dense_row["fits"], dense_row["reason"]
    assert dense_row["num_layers"] == LAYERS and dense_row["kv_tokens"] >= MAX_MODEL_LEN
    one_pool = dense_row["num_pages"] * 32 * 128 * 128 * 4  # one layer's recurrent pool (float32)
    for step in ("decode", "prefill"):
        program = dense_row[step]
        assert program["peak_bytes"] <= dense_row["budget_bytes"] <= dense_row["hbm_bytes"]
        assert program["alias_bytes"] >= dense_row["kv_bytes"]  # state pools and KV pages updated in place
        assert program["temp_bytes"] < one_pool, (step, program["temp_bytes"], one_pool)
