# SPDX-License-Identifier: Apache-2.0
"""Quantized Qwen3.5 (the dense tiny model: Gated DeltaNet layers beside a gated full-attention
one) through `vllm.LLM`, its method read from config.json: a `quant_method: fp8` checkpoint in
128x128 blocks (`in_proj_b` / `in_proj_a` left in float, as Qwen's FP8 release has them) and a
compressed-tensors W4A16 one (groups of 16 with zero points, packed by the package's own
`pack_to_int32`). The fused `in_proj_qkv` is cut into q, k and v at load
(`models.fused_outputs`); each engine generates, over a prompt longer than a step (chunked
prefill carrying the states) and a short one at once, what transformers (float32) does on the
dequantized weights, and its logprobs are transformers' log-softmax at those tokens.

fp8 is served in bfloat16 (vLLM's fp8 config refuses float32 activations): a token must be
transformers' argmax after the same tokens or within `TIE` of it (`test_fp8_engine`), and the
logprobs agree to bfloat16's rounding. W4A16 is served in float32: the same greedy tokens.

Malformed checkpoints are refused as the engine starts, by the tensor's name: an `in_proj_qkv`
whose q/k/v widths cut an fp8 scale block, and one whose scale is missing."""

import gc
import re

import numpy as np
import pytest
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from tests.greedy_reference import hf_greedy
from tests.models.fp8_checkpoints import dequantized_weights, write_block_fp8, write_float
from tests.models.test_qwen3_5_quantized import DENSE, FP8_WIDTHS
from tests.models.tiny_qwen3_next import save_tiny_qwen3_next
from tests.plugin_shim.test_fp8_engine import TIE

pytestmark = pytest.mark.slow  # engines

NEW_TOKENS = 6
# Steps of 32 tokens: the 37-token prompt is prefilled in two chunks.
_ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=16, seed=0)
# Each served logprob against transformers' float32 one on the same weights: bfloat16 activations
# carried through three recurrent layers drift by a few hundredths (about a tenth at worst here);
# float32 ones differ only in summation order.
BF16_LOGPROB_ATOL = 0.15
F32_LOGPROB_ATOL = 1e-4
_QKV = "model.layers.0.linear_attn.in_proj_qkv"
_BA_IGNORED = tuple(f"model.layers.{i}.linear_attn.in_proj_{p}" for i in range(3) for p in "ba")


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(44)
    return [[1, *rng.integers(3, 384, n - 1).tolist()] for n in (37, 9)]


def _serve(path: str, prompts, dtype: str) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens of an engine on `path` and each token's logprob."""
    llm = LLM(model=path, dtype=dtype, **_ENGINE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    finally:
        del llm
        gc.collect()
    tokens = [list(o.outputs[0].token_ids) for o in out]
    logprobs = [
        [step[t].logprob for step, t in zip(o.outputs[0].logprobs, ids, strict=True)]
        for o, ids in zip(out, tokens, strict=True)
    ]
    return tokens, logprobs


def _transformers_steps(hf, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """transformers' log-softmax over the vocabulary at each generated token's step."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].numpy()


def _reference(source: str, out: str, dequantized: dict[str, np.ndarray]):
    import torch
    import transformers

    path = write_float(source, out, dequantized)
    return getattr(transformers, DENSE).from_pretrained(path, dtype=torch.float32).eval()


def _block_fp8(root, **widths) -> tuple[str, str]:
    source = save_tiny_qwen3_next(str(root / "source"), seed=7, architecture=DENSE, **widths)
    return source, write_block_fp8(source, str(root / "fp8"), ignored=_BA_IGNORED)


def test_block_fp8_qwen3_5_generates_what_its_dequantized_model_does(tmp_path):
    source, path = _block_fp8(tmp_path, **FP8_WIDTHS)
    prompts = _prompts()
    generated, logprobs = _serve(path, prompts, "bfloat16")
    hf = _reference(source, str(tmp_path / "float"), dequantized_weights(path))
    assert [g[0] for g in generated] == [hf_greedy(hf, p, 1)[0] for p in prompts]
    for prompt, tokens, served in zip(prompts, generated, logprobs, strict=True):
        steps = _transformers_steps(hf, prompt, tokens)
        chosen = steps[np.arange(NEW_TOKENS), tokens]
        best = steps.max(-1)
        assert np.all(chosen >= best - TIE * np.abs(best)), (chosen, best)
        np.testing.assert_allclose(served, chosen, atol=BF16_LOGPROB_ATOL)


@pytest.mark.full  # the model test checks these logits; here the engine's acceptance and decode
def test_w4a16_qwen3_5_generates_what_its_dequantized_model_does(tmp_path):
    from tests.models.int4_checkpoints import write_packed_w4a16

    source = save_tiny_qwen3_next(str(tmp_path / "source"), seed=7, architecture=DENSE)
    path, dequantized = write_packed_w4a16(source, str(tmp_path / "w4a16"), group_size=16, symmetric=False)
    prompts = _prompts()
    generated, logprobs = _serve(path, prompts, "float32")
    hf = _reference(source, str(tmp_path / "float"), dequantized)
    assert generated == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    for prompt, tokens, served in zip(prompts, generated, logprobs, strict=True):
        chosen = _transformers_steps(hf, prompt, tokens)[np.arange(NEW_TOKENS), tokens]
        np.testing.assert_allclose(served, chosen, atol=F32_LOGPROB_ATOL)


def _without(path: str, name: str) -> None:
    """The checkpoint at `path` with tensor `name` removed (torch's reader: fp8 tensors too)."""
    from safetensors.torch import load_file, save_file

    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})


def _cut_block(root) -> str:
    # q and k 2 x 32 outputs: in_proj_qkv's 128-row scale blocks straddle q, k and v
    _, path = _block_fp8(root, **{**FP8_WIDTHS, "linear_key_head_dim": 32})
    return path


def _missing_fp8_scale(root) -> str:
    _, path = _block_fp8(root, **FP8_WIDTHS)
    _without(path, f"{_QKV}.weight_scale_inv")
    return path


def _missing_w4a16_scale(root) -> str:
    from tests.models.int4_checkpoints import write_packed_w4a16

    source = save_tiny_qwen3_next(str(root / "source"), architecture=DENSE)
    path, _ = write_packed_w4a16(source, str(root / "w4a16"), group_size=16, symmetric=False)
    _without(path, f"{_QKV}.weight_scale")
    return path


_MALFORMED = {
    "block_cut": (_cut_block, rf"'{re.escape(_QKV)}\.weight_scale_inv'.*\[64, 64, 128\].*multiples of 128"),
    "fp8_scale_missing": (
        _missing_fp8_scale,
        r"'model\.layers\.0\.linear_attn\.in_proj_q\.weight' .* holds fp8 values without a scale.*"
        r"cut from the checkpoint.s model\.layers\.0\.linear_attn\.in_proj_qkv\.weight\b",
    ),
    "w4a16_scale_missing": (
        _missing_w4a16_scale,
        r"lacks model\.layers\.0\.linear_attn\.in_proj_q\.weight_scale .*"
        r"cut from the checkpoint.s model\.layers\.0\.linear_attn\.in_proj_qkv\.weight_scale",
    ),
}


@pytest.mark.full  # each starts an engine up to its load; the model tests refuse the same at load
@pytest.mark.parametrize("kind", list(_MALFORMED))
def test_a_malformed_quantized_qwen3_5_is_refused_at_start_by_name(kind, tmp_path):
    write, message = _MALFORMED[kind]
    path = write(tmp_path)
    with pytest.raises(ValueError, match=message):
        LLM(model=path, dtype="bfloat16", **_ENGINE)
