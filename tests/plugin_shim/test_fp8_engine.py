# SPDX-License-Identifier: Apache-2.0
"""fp8 weights end to end through `vllm.LLM`: a float checkpoint quantized at load
(`quantization="fp8"`), a compressed-tensors FP8 checkpoint written by the compressed-tensors
package, and a `quant_method: fp8` checkpoint in 128x128 blocks, each with its method read from
config.json; each generates greedily what transformers (float32) does on the dequantized
weights, its projections held as fp8 on the device. The engine's activations are bfloat16, so a
token may differ from float32's choice where two are tied within bfloat16 rounding: each
generated token must be transformers' argmax after the same tokens, or within `TIE` of it. The
block checkpoint on 2 simulated devices generates what it does on one."""

import gc
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from models import fp8
from tests.greedy_reference import hf_greedy
from tests.models.fp8_checkpoints import (
    dequantized_weights,
    write_block_fp8,
    write_compressed_fp8,
    write_float,
)
from tests.models.trained_tiny import save_trained_tiny, text_ids
from tests.plugin_shim.tensor_parallel_engine import environment

pytestmark = pytest.mark.slow  # engines

NEW_TOKENS = 8
# Logits within this fraction of the step's largest are a tie at bfloat16 activations: two of
# bfloat16's roundings (2^-8 each), which a kernel summing in another order can flip upstream.
TIE = 2.0**-7
_ENGINE = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, seed=0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8_engine")


@pytest.fixture(scope="module")
def source(root):
    """A tiny float Llama trained on the fixed text whose every projection has whole 128-input
    blocks, two where a projection's inputs split over 2 devices (hidden 128, 8 heads of 32,
    intermediate 256)."""
    widths = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, head_dim=32)
    return save_trained_tiny("LlamaForCausalLM", str(root / "float"), **widths)


@pytest.fixture(scope="module")
def prompts(source):
    ids = text_ids(source)
    return [ids[:12], ids[40:61], ids[100:107]]


def _transformers(path: str):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _assert_greedy_of(hf, prompts, generated) -> None:
    import torch

    assert [g[0] for g in generated] == [hf_greedy(hf, p, 1)[0] for p in prompts]
    for prompt, tokens in zip(prompts, generated, strict=True):
        assert len(tokens) == NEW_TOKENS
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0].numpy()
        steps = logits[len(prompt) - 1 : -1]  # the logits each generated token was chosen from
        chosen = steps[np.arange(NEW_TOKENS), tokens]
        best = steps.max(-1)
        assert np.all(chosen >= best - TIE * np.abs(best)), (chosen, best)


def _fp8_kernels(worker) -> int:
    """How many of the engine's parameters are float8_e4m3fn."""
    leaves = jax.tree.leaves(worker.runner.state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return sum(fp8.is_fp8(v[...].dtype) for v in leaves)


def _generate(path: str, prompts, **kwargs) -> tuple[list[list[int]], int]:
    """Greedy tokens of an engine, and how many fp8 kernels it holds."""
    llm = LLM(model=path, **_ENGINE, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        kernels = llm.collective_rpc(_fp8_kernels)[0]
    finally:
        del llm
        gc.collect()
    return [list(o.outputs[0].token_ids) for o in out], kernels


def _per_channel_fp8(source: str) -> dict[str, np.ndarray]:
    """`source`'s weights with each projection quantized to fp8 per output channel (its `[out,
    in]` rows) and multiplied back, in NumPy; the head and everything else as they are."""
    from safetensors.numpy import load_file

    weights = load_file(f"{source}/model.safetensors")
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            scale = np.abs(w).max(axis=1, keepdims=True) / 448
            weights[name] = (w / scale).astype(fp8.FP8_DTYPE).astype(np.float32) * scale
    return weights


def test_fp8_at_load_generates_what_the_dequantized_model_does(source, prompts, root):
    reference = _transformers(write_float(source, str(root / "online_ref"), _per_channel_fp8(source)))
    generated, kernels = _generate(source, prompts, quantization="fp8")
    assert kernels == 2 * 4  # qkv, o, gate_up, down of each layer; the head stays bfloat16
    _assert_greedy_of(reference, prompts, generated)


def test_compressed_tensors_fp8_generates_what_the_dequantized_model_does(source, prompts, root):
    out = write_compressed_fp8(source, str(root / "ct_fp8"), "FP8_DYNAMIC")
    reference = _transformers(write_float(source, str(root / "ct_ref"), dequantized_weights(out)))
    generated, kernels = _generate(out, prompts)  # method from config.json: compressed-tensors
    assert kernels == 2 * 4
    _assert_greedy_of(reference, prompts, generated)


@pytest.fixture(scope="module")
def block_checkpoint(source, root):
    return write_block_fp8(source, str(root / "block_fp8"))  # vLLM: blocks with dynamic activations only


def test_block_fp8_generates_what_the_dequantized_model_does(block_checkpoint, source, prompts, root):
    reference = _transformers(
        write_float(source, str(root / "block_ref"), dequantized_weights(block_checkpoint))
    )
    generated, kernels = _generate(block_checkpoint, prompts)  # method from config.json: fp8
    assert kernels == 2 * 4
    _assert_greedy_of(reference, prompts, generated)


# `make test-full`: block-fp8 kernels and scales split on 2 devices equal to one device in make
# test on Qwen3.5 (tests/models/test_qwen3_5_quantized_on_mesh.py, the same split rules).
@pytest.mark.full
def test_block_fp8_on_two_devices_equals_one(block_checkpoint, prompts, tmp_path):
    """Tensor parallelism over 2 simulated devices (a subprocess: the device count is fixed when
    JAX starts): the fp8 kernels and their block scales split with their columns (o_proj's and
    down_proj's by rows: whole 128-input groups on each device); same tokens and logprobs, and
    each device holds half of each split fp8 kernel."""
    llm = dict(_ENGINE, max_num_batched_tokens=16)
    runs = [{"tp": tp, "prompts": prompts[:2], "new_tokens": 6, "llm": llm} for tp in (1, 2)]
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"model": block_checkpoint, "runs": runs}))
    env = {**environment(), "VLLM_XLA_ATTENTION_BACKEND": "xla"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.plugin_shim.tensor_parallel_engine", str(job), str(out)],
        env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    one, two = json.loads(out.read_text())
    assert two["tokens"] == one["tokens"]
    np.testing.assert_allclose(np.array(two["logprobs"]), np.array(one["logprobs"]), atol=1e-2)
    down = two["params"]["model.layers.0.mlp.down_proj.kernel"]
    assert down["device_bytes"] == [256 * 128 // 2] * 2  # fp8: one byte a weight, half each
    scale = two["params"]["model.layers.0.mlp.down_proj.kernel_scale"]
    assert scale["shape"] == [2, 128] and scale["device_bytes"] == [128 * 4] * 2  # a group each
