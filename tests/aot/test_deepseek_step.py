# SPDX-License-Identifier: Apache-2.0
"""A DeepSeek-V3-shaped step at full width (128 heads, latent 512, rope 64, low-rank queries of
1536, 256 routed experts of 2048 and one shared, hidden 7168) cut to a few layers, the first
dense and the rest MoE, compiled at TP=8 by XLA's GPU compiler for 8x H100
(`tensor_parallel_worker`, as test_tensor_parallel_step.py does for Llama and Qwen3-MoE): the
runner's step program (`tpu_platform.step_program`), every one of the layers compiled. `make
test` compiles two layers, one of each kind (what a layer exchanges or copies shows in one
layer); `make test-full` (`-m full`) four, one dense and three MoE.

It must fit each chip with the latent cache whole on every chip, page by page exactly
`(kv_lora_rank + qk_rope_head_dim) x 2` bytes a token a layer, and exchange only what the rules
table implies: per layer the row-parallel output projection's and MLP's sums of `[tokens,
hidden]` (a MoE layer a third, its shared experts'), the embedding's sum and the logits gathered
once; the replicated latent projections and cache need no exchange.

Under expert parallelism (`--enable-expert-parallel`, EP=8; `make test-full`, two layers, on
v6e-8 and 8x H100) each chip holds 32 of the 256 routed experts whole instead of an eighth of
each, and the step exchanges exactly what tensor parallelism's does: a device computes its
experts' rows of the replicated tokens and the MoE layer's one `[tokens, hidden]` sum combines
them, so no expert weight and no token moves.
"""

from __future__ import annotations

import json
from importlib import resources

import pytest

from tests.aot.model_step_worker import MAX_MODEL_LEN
from tests.aot.toolchains import run_worker
from tpu_platform.planner.plan import known_models

LATENT_WIDTH = 512 + 64
TARGETS = {"cuda": "h100x8"}
# Layers compiled: one dense and one MoE in `make test`, one dense and three MoE in `make test-full`.
LAYERS = [pytest.param(2, id="2-layers"), pytest.param(4, marks=pytest.mark.full, id="4-layers")]
EXPERT_PARALLEL_TARGETS = {"tpu": "v6e-8", "cuda": "h100x8"}
ROUTED_EXPERTS = 256

pytestmark = pytest.mark.timeout(3600)


def _config_path(tmp_path_factory, layers: int) -> str:
    """DeepSeek-V3's shipped configuration cut to `layers` layers, the first dense."""
    assert "deepseek-v3" in known_models()
    shipped = resources.files("tpu_platform.planner").joinpath("model_configs", "deepseek-v3.json")
    config = json.loads(shipped.read_text())
    config.update(num_hidden_layers=layers, first_k_dense_replace=1)
    path = tmp_path_factory.mktemp("deepseek") / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module", params=LAYERS)
def results(request, tmp_path_factory) -> dict[str, dict]:
    path = _config_path(tmp_path_factory, request.param)

    def compile_for(platform: str) -> tuple[str, dict]:
        (row,) = run_worker(
            platform, "tensor_parallel_worker", "full", f"{TARGETS[platform]}:{path}:8", timeout=3500
        )
        return platform, {**row, "layers": request.param}

    return dict(map(compile_for, TARGETS))


@pytest.fixture(scope="module")
def expert_parallel_results(tmp_path_factory) -> dict[str, dict]:
    path = _config_path(tmp_path_factory, 2)

    def compile_for(platform: str) -> tuple[str, dict]:
        target = EXPERT_PARALLEL_TARGETS[platform]
        (row,) = run_worker(platform, "tensor_parallel_worker", "full", f"{target}:{path}:8:ep", timeout=3500)
        return platform, row

    return dict(map(compile_for, EXPERT_PARALLEL_TARGETS))


@pytest.mark.parametrize("platform", sorted(TARGETS))
def test_v3_shaped_step_compiles_and_fits_each_chip_with_the_latent_cache_whole(results, platform):
    row = results[platform]
    assert row["fits"], row["reason"]
    assert row["tp_size"] == 8
    assert row["kv_tokens"] >= MAX_MODEL_LEN
    # bfloat16 latent rows, whole on every chip: 576 values a token a layer.
    assert row["kv_bytes"] == row["kv_tokens"] * row["layers"] * LATENT_WIDTH * 2
    total = row["total_weight_bytes"]
    # Replicated: norms, routers, correction biases and the latent projections (q_a, kv_a).
    assert row["replicated_weight_bytes"] <= 0.01 * total
    assert total / 8 <= row["weight_bytes"] <= total / 8 + row["replicated_weight_bytes"]
    for step in ("decode", "prefill"):
        program = row[step]
        assert program["peak_bytes"] <= row["budget_bytes"] <= row["hbm_bytes"]
        assert program["alias_bytes"] >= row["kv_bytes"]  # the donated latent cache updated in place


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_v3_shaped_step_exchanges_what_the_rules_table_implies(results, platform, step):
    assert results[platform]["unexpected_collectives"][step] == []


@pytest.mark.full
@pytest.mark.parametrize("platform", sorted(EXPERT_PARALLEL_TARGETS))
def test_v3_shaped_step_with_experts_by_index_holds_32_whole_experts_a_chip(
    expert_parallel_results, platform
):
    row = expert_parallel_results[platform]
    assert row["expert_parallel"] and row["fits"], row["reason"]
    assert row["chip_expert_bytes"] * 8 == row["expert_bytes"]
    assert row["expert_shards"]
    for shape, shard in row["expert_shards"]:  # split on the expert axis alone
        assert shape[0] == ROUTED_EXPERTS and shard == [ROUTED_EXPERTS // 8, *shape[1:]]
    for step in ("decode", "prefill"):
        program = row[step]
        assert program["peak_bytes"] <= row["budget_bytes"] <= row["hbm_bytes"]
        assert program["alias_bytes"] >= row["kv_bytes"]


@pytest.mark.full
@pytest.mark.parametrize("platform", sorted(EXPERT_PARALLEL_TARGETS))
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_v3_shaped_step_at_ep8_exchanges_only_activation_sums(expert_parallel_results, platform, step):
    row = expert_parallel_results[platform]
    assert row["unexpected_collectives"][step] == []
    kinds = {collective["kind"] for collective in row[step]["collectives"]}
    assert kinds <= {"all-reduce", "all-gather"}  # no all-to-all: no token is sent to its experts
