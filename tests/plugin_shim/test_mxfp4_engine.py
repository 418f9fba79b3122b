# SPDX-License-Identifier: Apache-2.0
"""A tiny GPT-OSS with mxfp4 experts, laid out as the released checkpoints are, through `vllm.LLM`
at TP=1 and TP=2 (8 simulated CPU devices, `tensor_parallel_engine`), in bfloat16 (the only dtype
vLLM allows with mxfp4). Its experts' F is one 32-value block, padded to one block a device at
TP=2. Reference: the dequantized checkpoint (decoded by transformers' own mxfp4 code) served in
bfloat16 by the float path, which `test_tensor_parallel` checks against transformers: every
FP4 value times its power-of-two scale is a bfloat16, so the two must generate the same tokens
with the same logprobs; and the first token of each prompt is transformers' float32 argmax (later
ones may differ from float32 where this random model's bfloat16 logits are near a tie)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.models.mxfp4_checkpoint import save_tiny_gpt_oss_mxfp4
from tests.plugin_shim.test_tensor_parallel import _greedy_run, _run_engines
from tpu_platform.weights.source import check_mxfp4_checkpoint

RUNS = [_greedy_run(1, dtype="bfloat16"), _greedy_run(2, dtype="bfloat16")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    path = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    return save_tiny_gpt_oss_mxfp4(path, seed=6, intermediate_size=32)


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    """Both checkpoints' runs in one subprocess (vLLM and JAX started once): the mxfp4 one's,
    then the dequantized reference's."""
    jobs = [{**run, "model": path} for path in checkpoints for run in RUNS]
    served = _run_engines(tmp_path_factory.mktemp("mxfp4"), "", jobs, "cpu_native")
    return served[: len(RUNS)], served[len(RUNS) :]


def _first_tokens(path: str, prompts: list[list[int]]) -> list[int]:
    import torch
    import transformers

    hf = transformers.GptOssForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        return [int(hf(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]


@pytest.mark.slow
def test_mxfp4_engine_generates_what_the_dequantized_model_does_at_tp_1_and_2(served, checkpoints):
    results, references = served
    first = _first_tokens(checkpoints[1], RUNS[0]["prompts"])
    for run, result, reference in zip(RUNS, results, references, strict=True):
        assert result["tokens"] == reference["tokens"], f"TP={run['tp']}"
        # TP=2: the padded experts' devices sum other bfloat16 partials than the float path's
        # (one device holds every real unit of F): rounding, not a different model.
        atol = 1e-5 if run["tp"] == 1 else 0.05
        np.testing.assert_allclose(
            result["logprobs"], reference["logprobs"], atol=atol, err_msg=f"TP={run['tp']}"
        )
        assert [tokens[0] for tokens in result["tokens"]] == first, f"TP={run['tp']}"


@pytest.mark.slow
def test_experts_stay_mxfp4_and_split_in_whole_blocks(served):
    results, _ = served
    for run, result in zip(RUNS, results, strict=True):
        tp, params = run["tp"], result["params"]
        experts = {p: v for p, v in params.items() if ".mlp.experts." in p}
        assert not any(p.endswith(("gate_up_proj", "down_proj")) for p in experts)  # no float copy
        blocks = params["model.layers.0.mlp.experts.down_proj_blocks"]
        # [E, D, F / 32, 16] uint8, F = 32 padded to one block a device at TP=2
        assert blocks["shape"] == [8, 64, tp, 16] and blocks["bytes"] == 8 * 64 * tp * 16
        assert blocks["device_bytes"] == [blocks["bytes"] // tp] * tp
        gate_up = params["model.layers.1.mlp.experts.gate_up_proj_scales"]
        assert gate_up["shape"] == [8, 64 * tp, 2]  # [E, 2F, D / 32]
        assert gate_up["device_bytes"] == [gate_up["bytes"] // tp] * tp


def test_quantization_mxfp4_on_a_float_checkpoint_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"]}))
    with pytest.raises(ValueError, match=r"quantization='mxfp4' .* does not quantize to mxfp4 at load"):
        check_mxfp4_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    check_mxfp4_checkpoint(str(tmp_path))
