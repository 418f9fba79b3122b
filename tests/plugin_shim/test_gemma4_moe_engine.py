# SPDX-License-Identifier: Apache-2.0
"""Gemma 4 with its MoE block (the tiny checkpoint of tests/models/test_gemma4_moe.py) through
`vllm.LLM` on our platform, in one subprocess of simulated CPU devices (as in
test_tensor_parallel.py): at TP=2 and at TP=2 with expert parallelism, greedy tokens
equal transformers' fp32 greedy continuation, logprobs agree and nothing compiles after warm-up;
the parameters are placed as the rules table says (the experts split inside each expert, or by
index under expert parallelism; the dense MLP beside them like any MLP; the router, its scales
and the MoE block's norms whole)."""

from __future__ import annotations

import numpy as np
import pytest

from models.sharding import parameter_spec
from tests.models.test_gemma4_moe import ARCH, save_tiny_gemma4_moe
from tests.plugin_shim.test_tensor_parallel import (
    LOGPROB_ATOL,
    _greedy_run,
    _hf_reference,
    _normalized,
    _run_engines,
)

pytestmark = pytest.mark.slow  # engines on simulated multi-device hosts

# TP=1 serves the path of tests/models/test_gemma4_moe.py (and the dense Gemma 4's engine run).
RUNS = [_greedy_run(2), _greedy_run(2, enable_expert_parallel=True)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma4_moe")
    path = save_tiny_gemma4_moe(str(tmp / "model"), seed=5)
    results = _run_engines(tmp, path, RUNS, "xla")
    references = [_hf_reference(ARCH, path, run["prompts"]) for run in RUNS]
    return results, references


def test_greedy_tokens_and_logprobs_match_transformers(served):
    results, references = served
    for run, result, (tokens, logprobs) in zip(RUNS, results, references, strict=True):
        name = f"TP={run['tp']} EP={run['llm'].get('enable_expert_parallel', False)}"
        assert result["tokens"] == tokens, name
        np.testing.assert_allclose(
            np.asarray(result["logprobs"]), np.asarray(logprobs), atol=LOGPROB_ATOL, err_msg=name
        )
        assert result["stats"]["compiles_after_warmup"] == 0, name


@pytest.mark.parametrize("run", [0, 1], ids=["tp2", "tp2_expert_parallel"])
def test_parameters_are_placed_as_the_rules_table_says(served, run):
    results, _ = served
    expert_parallel = RUNS[run]["llm"].get("enable_expert_parallel", False)
    split, whole = set(), set()
    for path, placed in results[run]["params"].items():
        expected = parameter_spec(path, tuple(placed["shape"]), 2, expert_parallel=expert_parallel)
        assert _normalized(placed["spec"]) == _normalized(list(expected)), path
        if any(expected):
            assert placed["device_bytes"] == [placed["bytes"] // 2] * 2, path
            split.add(path.split(".", 3)[-1])  # the path under `model.layers.{i}.`
        else:
            whole.add(path.split(".", 3)[-1])
    experts = {f"moe.experts.{p}.kernel" for p in ("gate_proj", "up_proj", "down_proj")}
    assert experts | {"mlp.gate_up_proj.kernel", "mlp.down_proj.kernel"} <= split, split
    moe_whole = {"moe.router.kernel", "moe.router_scale", "moe.per_expert_scale"}
    norms = {"pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_2.weight"}
    assert moe_whole | norms <= whole, whole
