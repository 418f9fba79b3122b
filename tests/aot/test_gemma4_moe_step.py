# SPDX-License-Identifier: Apache-2.0
"""A gemma-4-26B-A4B-shaped step at full width (16 query heads; sliding layers of 8 KV heads of
256, a full layer of 2 KV heads of 512 whose keys are its values; 128 experts of 704, 8 a token,
beside each layer's dense MLP of 2112; hidden 2816, vocabulary 262144) with its first six layers
(five sliding, one full), compiled by the real compilers for one chip (`model_step_worker`,
weights abstract): on a v6e chip with int8 weights (how the whole model fits one:
`benchmarks/plan.py`'s row) and on an H100 in bfloat16. Each fits its chip, takes the weights
and the cache and updates the donated cache in place; its temporaries stay far below the cache.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import pytest

from tests.aot.model_step_worker import MAX_MODEL_LEN
from tests.aot.toolchains import run_worker
from tests.models.test_gemma4_moe import gemma4_26b_parameters

LAYERS = 6
CASES = {"tpu": "v6e-1:{path}:int8", "cuda": "h100x1:{path}"}
BACKEND = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}
D, V = 2816, 262_144

# Two full compiles of six MoE layers at full width a platform: `make test-full`.
pytestmark = [pytest.mark.full, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """The shipped gemma-4-26B-A4B config cut to its first layers, every one of them compiled."""
    shipped = resources.files("tpu_platform.planner").joinpath("model_configs", "gemma-4-26b-a4b.json")
    config = json.loads(shipped.read_text())
    config.update(num_hidden_layers=LAYERS, layer_types=config["layer_types"][:LAYERS])
    path = tmp_path_factory.mktemp("gemma4_moe") / "config.json"
    path.write_text(json.dumps(config))

    def one(platform: str) -> dict:
        case = CASES[platform].format(path=path)
        return run_worker(platform, "model_step_worker", "full", case, timeout=3500)[0]

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(CASES, pool.map(one, CASES), strict=True))


@pytest.mark.parametrize("platform", sorted(CASES))
def test_six_layers_compile_and_fit_one_chip(results, platform):
    row = results[platform]
    assert row["fits"], row["reason"]
    assert row["backend"] == BACKEND[platform]
    assert row["kv_tokens"] >= MAX_MODEL_LEN
    parameters = gemma4_26b_parameters(LAYERS)
    if platform == "cuda":  # bfloat16, the tied head served from its own `[D, V]` copy
        assert row["weight_bytes"] == pytest.approx(2 * (parameters + D * V), rel=0.01)
    else:  # int8 kernels (the head's copy too) with their scales; the embedding table in bfloat16
        assert row["weight_bytes"] == pytest.approx(parameters + V * D * 2, rel=0.02)
    for step in ("decode", "prefill"):
        program = row[step]
        assert program["argument_bytes"] >= row["weight_bytes"] + row["kv_bytes"]
        assert program["alias_bytes"] >= row["kv_bytes"]  # the donated caches updated in place
        assert program["peak_bytes"] <= row["budget_bytes"]
        assert program["temp_bytes"] < row["kv_bytes"] // 8, (step, program["temp_bytes"], row["kv_bytes"])
