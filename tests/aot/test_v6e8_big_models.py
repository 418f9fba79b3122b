# SPDX-License-Identifier: Apache-2.0
"""The largest families on one v6e host (8 chips, TP=8), by the real TPU compiler (`full`: tens
of minutes on two cores; `make test` checks the same step programs on 8x H100).

- Llama-4-Scout (bfloat16, 16 experts and a shared one, chunked and NoPE layers) from its first
  2 and 4 layers at full width, the memory extrapolated to its 48 (`tensor_parallel_worker
  depth`): it fits, each chip holding an eighth of every split weight, with room for a KV cache
  of at least one whole sequence, and each short program exchanges only what the rules table
  implies.
- DeepSeek-V3 as its block-fp8 checkpoint ships (`fp8-g128`: fp8 values, a scale per 128 inputs
  of each column) cut to four layers at full width, one dense and three MoE, every one compiled
  (`tensor_parallel_worker full`): the whole model does not fit a v6e-8 in any format (its
  weights alone, `tests/tpu_platform/test_plan.py`), but the step that would serve it on more
  chips compiles, holds its latent cache whole on every chip at 576 values a token a layer
  (640 lanes), updates it in place, holds no cache-sized temporary and exchanges only what the rules table
  implies.
"""

from __future__ import annotations

import json
from importlib import resources

import pytest

from tests.aot.model_step_worker import MAX_MODEL_LEN
from tests.aot.toolchains import run_worker

pytestmark = [pytest.mark.full, pytest.mark.timeout(3600)]

SCOUT = "v6e-8:llama-4-scout:8"
SCOUT_PARAMETERS = 107.77e9  # the text model's, of the 109e9 on the model card
# On TPU a token's latent row is the 512 compressed values and its 64 rope values, each part
# padded to whole rows of 128 lanes (`pallas_kernels.mla`).
V3_LAYERS, LATENT_LANES = 4, 512 + 128


@pytest.fixture(scope="module")
def scout() -> dict:
    return run_worker("tpu", "tensor_parallel_worker", "depth", SCOUT, timeout=3500)[0]


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> dict:
    shipped = resources.files("tpu_platform.planner").joinpath("model_configs", "deepseek-v3.json")
    config = json.loads(shipped.read_text())
    config.update(num_hidden_layers=V3_LAYERS, first_k_dense_replace=1)
    path = tmp_path_factory.mktemp("deepseek_v3") / "config.json"
    path.write_text(json.dumps(config))
    return run_worker("tpu", "tensor_parallel_worker", "full", f"v6e-8:{path}:8:fp8-g128", timeout=3500)[0]


def test_scout_fits_a_v6e_8_with_an_eighth_of_its_weights_a_chip(scout):
    assert scout["fits"], scout["reason"]
    assert (scout["tp_size"], scout["backend"]) == (8, "pallas_tpu")
    total = scout["total_weight_bytes"]
    assert total == pytest.approx(2 * SCOUT_PARAMETERS, rel=0.01)  # bfloat16
    assert scout["replicated_weight_bytes"] <= 0.005 * total
    assert total / 8 <= scout["weight_bytes"] <= total / 8 + scout["replicated_weight_bytes"]
    assert scout["kv_tokens"] >= MAX_MODEL_LEN
    for step in ("decode", "prefill"):
        for program in scout["short"][step]:  # the chip's shards in, the donated cache in place
            assert program["alias_bytes"] > 0 and program["peak_bytes"] <= scout["budget_bytes"]
        assert scout["predicted_peak_bytes"][step] <= scout["steps_budget_bytes"] <= scout["budget_bytes"]


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_scout_exchanges_what_the_rules_table_implies(scout, step):
    assert scout["unexpected_collectives"][step] == []


def test_v3_block_fp8_step_fits_each_chip_with_the_latent_cache_whole(deepseek_v3):
    row = deepseek_v3
    assert row["fits"], row["reason"]
    assert (row["tp_size"], row["backend"], row["quantization"]) == (8, "pallas_tpu", "fp8-g128")
    assert row["kv_tokens"] >= MAX_MODEL_LEN
    # The latent rows, bfloat16, whole on every chip: 640 lanes a token a layer.
    assert row["kv_bytes"] == row["kv_tokens"] * V3_LAYERS * LATENT_LANES * 2
    total = row["total_weight_bytes"]
    # Replicated: norms, routers, correction biases and the latent projections (q_a, kv_a).
    assert row["replicated_weight_bytes"] <= 0.02 * total
    assert total / 8 <= row["weight_bytes"] <= total / 8 + row["replicated_weight_bytes"]
    for step in ("decode", "prefill"):
        program = row[step]
        assert program["peak_bytes"] <= row["budget_bytes"] <= row["hbm_bytes"]
        assert program["alias_bytes"] >= row["kv_bytes"]  # the donated latent cache updated in place
        assert program["temp_bytes"] < row["kv_bytes"] // 8, (step, program["temp_bytes"], row["kv_bytes"])


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_v3_block_fp8_step_exchanges_what_the_rules_table_implies(deepseek_v3, step):
    assert deepseek_v3["unexpected_collectives"][step] == []
