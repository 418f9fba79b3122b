# SPDX-License-Identifier: Apache-2.0
"""GLM-4.5 through `vllm.LLM` on our platform, at TP=1 and TP=2 on simulated CPU devices (one
subprocess a checkpoint, as in test_tensor_parallel.py): greedy tokens equal transformers' fp32
greedy continuation and logprobs agree; the parameters are placed as the rules table says (heads
with their q/k/v biases, each routed expert's intermediate size, the shared experts and the dense
MLP like a dense MLP; the router and its correction bias whole) and each device holds half the
KV cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from models.sharding import parameter_spec
from tests.models.tiny_glm4_moe import save_tiny_glm4_moe
from tests.plugin_shim.test_tensor_parallel import (
    LOGPROB_ATOL,
    _greedy_run,
    _hf_reference,
    _normalized,
    _run_engines,
)

pytestmark = pytest.mark.slow  # engines on simulated multi-device hosts

# GLM-4.5's shape (q/k norms; GLM-4.5-Air's differs in the q/k norm and the routing only, which
# the logits tests of tests/models/test_glm4_moe.py check) at TP=2, and at TP=1 in `make test-full`
# (the one-device engine path is every other family's engine test's in `make test`).
VARIANT = "qk_norm"
TP_SIZES = [pytest.param(2, id=VARIANT), pytest.param(1, id=f"{VARIANT}-tp1", marks=pytest.mark.full)]


@pytest.fixture(scope="module", params=TP_SIZES)
def served(request, tmp_path_factory):
    runs = [_greedy_run(request.param, block_size=16)]
    tmp = tmp_path_factory.mktemp(f"{VARIANT}_tp{request.param}")
    path = save_tiny_glm4_moe(VARIANT, str(tmp / "model"))
    results = _run_engines(tmp, path, runs, "cpu_native")
    references = [_hf_reference("Glm4MoeForCausalLM", path, run["prompts"]) for run in runs]
    return runs, results, references


def test_greedy_tokens_and_logprobs_match_transformers(served):
    runs, results, references = served
    for run, result, (tokens, logprobs) in zip(runs, results, references, strict=True):
        assert result["tokens"] == tokens, f"TP={run['tp']}"
        np.testing.assert_allclose(
            np.asarray(result["logprobs"]), np.asarray(logprobs), atol=LOGPROB_ATOL, err_msg=f"TP={run['tp']}"
        )
        assert result["stats"]["compiles_after_warmup"] == 0, f"TP={run['tp']}"


def test_parameters_and_cache_are_placed_as_the_rules_table_says(served):
    runs, results, _ = served
    if all(run["tp"] == 1 for run in runs):
        pytest.skip("one device: nothing is split")
    for run, result in zip(runs, results, strict=True):
        tp = run["tp"]
        split, whole = set(), set()
        for path, placed in result["params"].items():
            expected = parameter_spec(path, tuple(placed["shape"]), tp)
            assert _normalized(placed["spec"]) == _normalized(list(expected)), path
            if any(expected):
                assert placed["device_bytes"] == [placed["bytes"] // tp] * tp, path
                split.add(path.split(".", 3)[-1])  # the path under `model.layers.{i}.`
            else:
                assert placed["device_bytes"] == [placed["bytes"]] * tp, path
                whole.add(path.split(".", 3)[-1])
        assert {
            "self_attn.qkv_proj.kernel",
            "self_attn.qkv_proj.bias",
            "self_attn.o_proj.kernel",
            "mlp.gate_up_proj.kernel",  # layer 0's dense MLP
            "mlp.experts.gate_proj.kernel",
            "mlp.experts.down_proj.kernel",
            "mlp.shared_experts.gate_up_proj.kernel",
            "mlp.shared_experts.down_proj.kernel",
        } <= split, split
        assert {"mlp.router.kernel", "mlp.e_score_correction_bias"} <= whole, whole
        for cache in result["caches"]:
            assert cache["device_bytes"] == [cache["bytes"] // tp] * tp
