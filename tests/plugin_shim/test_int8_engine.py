# SPDX-License-Identifier: Apache-2.0
"""int8 weights end to end through `vllm.LLM(quantization=...)`: quantized at load from a float
checkpoint, a compressed-tensors int8 checkpoint and a GGUF's Q8_0 weights (scales per block of
32 inputs) as they are; each generates greedily what transformers (float32) does on the
dequantized weights. On a CPU with the native dense kernel the
int8 kernels run packed on its int8 path (`pallas_kernels.cpu.native_dense_int8`), and the same
engine on XLA's int8 dots (the `xla` backend) generates the same first tokens and greedy ones
after. The engine's activations are bfloat16 (vLLM allows these methods with 16-bit activations
only), so a token may differ from float32's choice where two are tied within bfloat16 rounding:
each generated token must be transformers' argmax after the same tokens, or within `TIE` of it.
Other methods are refused by name, with the list."""

import gc
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from models import PackedKernel
from models.gguf_reader import iter_hf_tensors
from models.linear import native_dense_takes_groups
from pallas_kernels import cpu
from plugin_shim import feature_check
from tests.greedy_reference import hf_greedy
from tests.models.test_compressed_tensors import write_compressed
from tests.models.test_gguf_q8_0 import write_q8_0_gguf
from tests.models.trained_tiny import save_trained_tiny, text_ids
from tests.plugin_shim.tensor_parallel_engine import environment
from tests.plugin_shim.test_fp8_engine import TIE

pytestmark = pytest.mark.slow  # engines

NEW_TOKENS = 8
_ENGINE = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, seed=0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return save_trained_tiny("LlamaForCausalLM", str(tmp_path_factory.mktemp("int8_engine") / "llama"))


@pytest.fixture(scope="module")
def prompts(trained):
    ids = text_ids(trained)
    return [ids[:12], ids[40:61], ids[100:107]]


@pytest.fixture(scope="module")
def dequantized(trained):
    """transformers fp32 greedy on the dequantized weights: every projection and the LM head
    quantized per output channel (its `[out, in]` rows) and multiplied back, in NumPy."""
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("_proj.weight") or name == "lm_head.weight":
                w = param.numpy().astype(np.float64)
                scale = np.abs(w).max(axis=1, keepdims=True) / 127
                param.copy_(
                    torch.from_numpy((np.clip(np.rint(w / scale), -127, 127) * scale).astype(np.float32))
                )
    return hf


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


def _int8_kernels(worker) -> dict[str, int]:
    """How many of the engine's int8 kernels are packed for the native int8 kernel, how many not."""
    leaves = jax.tree.leaves(worker.runner.state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    kinds = [
        "packed" if isinstance(v, PackedKernel) else "unpacked" for v in leaves if v[...].dtype == np.int8
    ]
    return {kind: kinds.count(kind) for kind in set(kinds)}


def _generate(path: str, prompts, kernels: dict | None = None, **kwargs) -> list[list[int]]:
    """Greedy tokens of an engine; `kernels` receives `_int8_kernels` of it."""
    llm = LLM(model=path, **_ENGINE, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        assert llm.llm_engine.vllm_config.model_config.quantization in feature_check.SUPPORTED_QUANTIZATION
        if kernels is not None:
            kernels.update(llm.collective_rpc(_int8_kernels)[0])
    finally:
        del llm
        gc.collect()
    return [list(o.outputs[0].token_ids) for o in out]


@pytest.fixture(scope="module")
def int8_at_load(trained, prompts):
    """The tokens and int8 kernels of the default engine (the native dense kernel where it runs)."""
    kernels: dict[str, int] = {}
    return _generate(trained, prompts, kernels, quantization="int8_per_channel_weight_only"), kernels


def test_int8_at_load_generates_what_the_dequantized_model_does(int8_at_load, prompts, dequantized):
    _assert_greedy_of(dequantized, prompts, int8_at_load[0])


def test_int8_kernels_run_packed_on_the_native_int8_kernel(int8_at_load, dense_kernels):
    """Every int8 kernel (each projection, the LM head) is packed for the native int8 kernel."""
    assert cpu.dense_int8_isas(dense_kernels)
    assert set(int8_at_load[1]) == {"packed"} and int8_at_load[1]["packed"] > 0


def test_xla_int8_generates_as_native_int8_does(
    int8_at_load, trained, prompts, dequantized, monkeypatch, dense_kernels
):
    """XLA's int8 dots multiply bfloat16 x, the native kernel (on AVX-512 VNNI) x in 16-bit fixed
    point: the same first tokens, and every token greedy within `TIE` as the native ones are."""
    monkeypatch.setenv("VLLM_XLA_ATTENTION_BACKEND", "xla")  # no native kernels: XLA's int8 dots
    kernels: dict[str, int] = {}
    generated = _generate(trained, prompts, kernels, quantization="int8_per_channel_weight_only")
    assert set(kernels) == {"unpacked"}
    assert [g[0] for g in generated] == [g[0] for g in int8_at_load[0]]
    _assert_greedy_of(dequantized, prompts, generated)


def test_compressed_tensors_checkpoint_generates_what_the_dequantized_model_does(
    trained, prompts, dequantized, tmp_path
):
    out = str(tmp_path / "w8a16")
    write_compressed(trained, out, fmt="pack-quantized", strategy="channel")
    for name in os.listdir(trained):  # the tokenizer files come with the copy; nothing else to add
        assert os.path.exists(os.path.join(out, name))
    _assert_greedy_of(dequantized, prompts, _generate(out, prompts))  # method from config.json
    shutil.rmtree(out)


def test_q8_0_gguf_generates_what_its_dequantized_model_does(trained, prompts, tmp_path):
    """A model directory holding the Q8_0 GGUF itself (config.json and tokenizer beside it):
    its int8 values and block scales serve as they are, on XLA's grouped int8 dot unless the
    native int8 kernel takes grouped scales."""
    import torch
    from transformers import LlamaForCausalLM

    out = str(tmp_path / "q8_0")
    write_q8_0_gguf(trained, out)
    for name in os.listdir(trained):  # the tokenizer files
        if not name.endswith((".safetensors", "config.json")) or name == "tokenizer_config.json":
            shutil.copy(os.path.join(trained, name), out)
    float_dir = str(tmp_path / "dequantized")
    shutil.copytree(trained, float_dir)  # the file's own values, as transformers' weights
    save_file(
        dict(iter_hf_tensors(os.path.join(out, "model.gguf"))), os.path.join(float_dir, "model.safetensors")
    )
    hf = LlamaForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    kernels: dict[str, int] = {}
    _assert_greedy_of(
        hf, prompts, _generate(out, prompts, kernels, quantization="int8_per_channel_weight_only")
    )
    assert set(kernels) == ({"packed"} if native_dense_takes_groups() else {"unpacked"})
    shutil.rmtree(out)


# `make test-full`: tests/tpu_platform/test_int8_tensor_parallel.py streams int8 weights onto 2
# and 4 devices in `make test` (each device's kernels and scales, the logits the host-quantized
# model's), and the engine tests above take the option through vLLM on one device.
@pytest.mark.full
def test_int8_on_two_devices_equals_one(trained, prompts, tmp_path):
    """Tensor parallelism over 2 simulated devices (a subprocess: the device count is fixed when
    JAX starts): the int8 kernels and scales split with their columns; same tokens and logprobs."""
    llm = dict(_ENGINE, quantization="int8_per_channel_weight_only", max_num_batched_tokens=16)
    runs = [{"tp": tp, "prompts": prompts[:2], "new_tokens": 6, "llm": llm} for tp in (1, 2)]
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"model": trained, "runs": runs}))
    env = {**environment(), "VLLM_XLA_ATTENTION_BACKEND": "xla"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.plugin_shim.tensor_parallel_engine", str(job), str(out)],
        env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    one, two = json.loads(out.read_text())
    assert two["tokens"] == one["tokens"]
    np.testing.assert_allclose(np.array(two["logprobs"]), np.array(one["logprobs"]), atol=1e-2)


@pytest.mark.parametrize("method", ["fp8_per_tensor", "experts_int8", "moe_wna16"])
def test_other_methods_are_refused_with_the_supported_list(trained, method):
    with pytest.raises(ValueError) as raised:
        LLM(model=trained, quantization=method, **_ENGINE)
    assert f"quantization={method!r}" in str(raised.value) or "quantization (" in str(raised.value)
    for supported in feature_check.SUPPORTED_QUANTIZATION:
        assert supported in str(raised.value)
