# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V2 and V3 through `vllm.LLM` on our platform, at TP=1 and TP=2 on simulated CPU
devices (one subprocess a checkpoint, as in test_tensor_parallel.py): greedy tokens equal
transformers' fp32 greedy continuation and logprobs agree; vLLM sized the cache from our MLA
spec, so the latent cache holds `kv_lora_rank + qk_rope_head_dim` values a token a layer, whole
on every device; the heads' projections are split as the rules table says.
"""

from __future__ import annotations

import numpy as np
import pytest

from models.sharding import parameter_spec
from tests.models.tiny_deepseek import LATENT_WIDTH, save_tiny_deepseek
from tests.plugin_shim.test_tensor_parallel import (
    LOGPROB_ATOL,
    _greedy_run,
    _hf_reference,
    _normalized,
    _run_engines,
)

pytestmark = pytest.mark.slow  # engines on simulated multi-device hosts

# variant -> (its architecture, engine runs): V3 at TP=1 and 2, V2-Lite at TP=2 (its one-device
# step is the logits tests' in tests/models/test_deepseek.py).
VARIANTS = {
    "v2_lite_greedy": ("DeepseekV2ForCausalLM", [_greedy_run(2, block_size=16)]),
    "v3_noaux_yarn": (
        "DeepseekV3ForCausalLM",
        [_greedy_run(1, block_size=16), _greedy_run(2, block_size=16)],
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def served(request, tmp_path_factory):
    architecture, runs = VARIANTS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    path = save_tiny_deepseek(request.param, str(tmp / "model"))
    results = _run_engines(tmp, path, runs, "xla")
    references = [_hf_reference(architecture, path, run["prompts"]) for run in runs]
    return runs, results, references


def test_greedy_tokens_and_logprobs_match_transformers(served):
    runs, results, references = served
    for run, result, (tokens, logprobs) in zip(runs, results, references, strict=True):
        assert result["tokens"] == tokens, f"TP={run['tp']}"
        np.testing.assert_allclose(
            np.asarray(result["logprobs"]), np.asarray(logprobs), atol=LOGPROB_ATOL, err_msg=f"TP={run['tp']}"
        )


def test_latent_cache_holds_one_row_a_token_whole_on_every_device(served):
    runs, results, _ = served
    for run, result in zip(runs, results, strict=True):
        tp = run["tp"]
        (cache,) = result["caches"]  # every layer's pages stacked in one array
        pages, row = cache["shape"]
        page_size = 16
        # float32: (kv_lora_rank + qk_rope_head_dim) x 4 bytes a token a layer
        assert row == page_size * LATENT_WIDTH
        assert cache["bytes"] == pages * page_size * LATENT_WIDTH * 4
        assert cache["devices"] == tp and cache["device_bytes"] == [cache["bytes"]] * tp
        assert _normalized(cache["spec"]) == []


def test_heads_are_split_as_the_rules_table_says(served):
    runs, results, _ = served
    for run, result in zip(runs, results, strict=True):
        tp = run["tp"]
        if tp == 1:
            continue
        split = set()
        for path, placed in result["params"].items():
            expected = parameter_spec(path, tuple(placed["shape"]), tp)
            assert _normalized(placed["spec"]) == _normalized(list(expected)), path
            if any(expected):
                assert placed["device_bytes"] == [placed["bytes"] // tp] * tp, path
                split.add(path.rsplit(".", 2)[-2])
        assert {"kv_b_proj", "o_proj", "gate_proj", "down_proj"} <= split, split
        assert "kv_a_proj_with_mqa" not in split
