# SPDX-License-Identifier: Apache-2.0
"""A GLM-4.5-Air-shaped step at full width (96 query and 8 KV heads of 128 with q/k/v biases,
RoPE on 64 of each head's 128 dimensions, 128 routed experts of 1408 and one shared, hidden
4096, vocabulary 151552) with its first two layers, one dense and one MoE, and four, one dense
and three MoE (what a layer holds and exchanges shows in each; both in `make test-full`), compiled at TP=4
by XLA's GPU compiler for 4 of 8x H100 (`tensor_parallel_worker`, as
test_tensor_parallel_step.py does for Llama and Qwen3-MoE). Not on v6e-4: at TP=4 the whole
model's bfloat16 weights take 53.5 GB a chip, more than a v6e chip holds.

Each chip holds a quarter of every split weight and its two KV heads' cache, and the step
exchanges only what the rules table implies: per layer the row-parallel output projection's and
MLP's sums of `[tokens, hidden]` (a MoE layer a third, its shared expert's), the embedding's sum
and the logits gathered once; it holds no cache-sized temporary (the partial rotation runs
outside the fused RoPE-and-write path, on the step's own tokens).
"""

from __future__ import annotations

import json
from importlib import resources

import pytest

from tests.aot.model_step_worker import MAX_MODEL_LEN
from tests.aot.toolchains import run_worker

TP = 4
# Both depths are `make test-full`'s: the same rules (row-parallel sums, a mixture of experts split
# inside each expert) compile for 8x H100 in test_tensor_parallel_step.py (Qwen3-30B-A3B), and
# GLM-4.5's placement at TP=2 runs on simulated devices (tests/plugin_shim/test_glm4_moe_engine.py).
LAYERS = [
    pytest.param(2, marks=pytest.mark.full, id="2-layers"),
    pytest.param(4, marks=pytest.mark.full, id="4-layers"),
]
TARGETS = {"cuda": "h100x8"}
BACKEND = {"cuda": "pallas_gpu"}

pytestmark = pytest.mark.timeout(3600)


def _parameters(layers: int) -> int:
    """GLM-4.5-Air's parameters in its first `layers` layers (the first dense), with the
    embedding, the head and the final norm, from its published shapes."""
    d, v, heads, kv_heads, h = 4096, 151552, 96, 8, 128
    attention = d * heads * h + heads * h + 2 * (d * kv_heads * h + kv_heads * h) + heads * h * d
    norms = 2 * d
    dense = 3 * d * 10944
    moe = 128 * 3 * d * 1408 + 3 * d * 1408 + 128 * d + 128  # routed, shared, router, bias
    return 2 * v * d + d + layers * (attention + norms) + dense + (layers - 1) * moe


@pytest.fixture(scope="module", params=LAYERS)
def results(request, tmp_path_factory) -> dict[str, dict]:
    """The shipped GLM-4.5-Air config cut to its first layers, every one of them compiled."""
    shipped = resources.files("tpu_platform.planner").joinpath("model_configs", "glm-4.5-air.json")
    config = json.loads(shipped.read_text())
    config.update(num_hidden_layers=request.param)
    path = tmp_path_factory.mktemp("glm") / "config.json"
    path.write_text(json.dumps(config))
    return {
        p: {
            **run_worker(p, "tensor_parallel_worker", "full", f"{target}:{path}:{TP}", timeout=3500)[0],
            "layers": request.param,
        }
        for p, target in TARGETS.items()
    }


@pytest.mark.parametrize("platform", sorted(TARGETS))
def test_air_shaped_step_compiles_and_fits_each_chip(results, platform):
    row = results[platform]
    assert row["fits"], row["reason"]
    assert (row["tp_size"], row["backend"]) == (TP, BACKEND[platform])
    assert row["kv_tokens"] >= MAX_MODEL_LEN
    total = row["total_weight_bytes"]
    assert total == pytest.approx(2 * _parameters(row["layers"]), rel=1e-4)  # bfloat16
    # Replicated: norms, routers and their correction biases.
    assert row["replicated_weight_bytes"] <= 0.005 * total
    assert total / TP <= row["weight_bytes"] <= total / TP + row["replicated_weight_bytes"]
    for step in ("decode", "prefill"):
        program = row[step]
        assert program["peak_bytes"] <= row["budget_bytes"] <= row["hbm_bytes"]
        assert program["alias_bytes"] >= row["kv_bytes"]  # the donated caches updated in place
        assert program["temp_bytes"] < row["kv_bytes"] // 8, (step, program["temp_bytes"], row["kv_bytes"])


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_air_shaped_step_exchanges_what_the_rules_table_implies(results, platform, step):
    assert results[platform]["unexpected_collectives"][step] == []
