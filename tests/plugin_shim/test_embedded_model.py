# SPDX-License-Identifier: Apache-2.0
"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF) through vLLM on the XLA platform."""

import gc
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer
from vllm import LLM, SamplingParams

from models import PackedKernel, pack_for_native_dense
from models.gguf_reader import unpermute_rope_rows
from models.linear import Linear, is_packed_int4
from plugin_shim.active import assert_active
from plugin_shim.model_dir import materialize
from tests.models.tiny_checkpoints import PAGE, caches, run_step
from tpu_platform.envs import read_env
from tpu_platform.weights.preparation import Preparation
from tpu_platform.weights.prepared import load_prepared

# Steps of up to 16 tokens: the prompt prefills in one, and warm-up compiles the 30-layer
# forward for 3 token buckets (1, 4, 16) instead of 7 (up to 256).
PROMPT_STEP_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir():
    return materialize(read_env().cache_dir)


def test_model_dir_is_an_hf_directory(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    assert config["tie_word_embeddings"] is True
    assert os.path.exists(os.path.join(model_dir, "tokenizer.json"))
    assert materialize(read_env().cache_dir) == model_dir  # reused, not rebuilt


def test_the_embedded_gguf_is_kept_with_its_4bit_blocks(model_dir):
    """Its projections are all Q4_1 and its embedding Q8_0: the directory holds the file itself
    (served from its blocks), and the served preparation is int4 with an offset per 32 inputs."""
    import filecmp

    from models.checkpoint_kinds import gguf_4bit_quantization, gguf_q8_0_embedding
    from plugin_shim.model_dir import embedded_gguf_path

    assert filecmp.cmp(os.path.join(model_dir, "model.gguf"), embedded_gguf_path(), shallow=False)
    assert not os.path.exists(os.path.join(model_dir, "model.safetensors"))
    assert gguf_4bit_quantization(model_dir) == "int4z-g32"
    assert gguf_q8_0_embedding(model_dir)  # its tied head served as the file's Q8_0 blocks, float16 d


@pytest.mark.slow
def test_the_embedded_q4_1_blocks_fit_float16_scales_exactly(model_dir):
    """Served on CPU, its Q4_1 blocks keep their d and minimum in float16 (`gguf_float16_scales`):
    every block's float16 base is its float32 `m - 8 d` exactly, so the int4 kernel computes bit
    for bit what the float32 scales and offsets give (tests/pallas_kernels/test_cpu_dense_int4_float16.py)."""
    from models.checkpoint_kinds import gguf_float16_scales
    from models.gguf_reader import iter_hf_tensors, q4_linear_weights
    from pallas_kernels.cpu import float16_scales

    assert gguf_float16_scales(model_dir)
    path = os.path.join(model_dir, "model.gguf")
    tensors = dict(iter_hf_tensors(path, int4_q4=True))
    for name in q4_linear_weights(path):
        scale, offset = tensors[f"{name}_scale"], tensors[f"{name}_offset"]
        half, base = float16_scales(scale, offset)
        np.testing.assert_array_equal(half, scale)
        np.testing.assert_array_equal(base, offset - 8 * scale)


def _greedy_tokens(model, config, prompt: list[int], count: int) -> list[int]:
    """`count` greedy tokens after `prompt`, a prefill then one decode step a token."""
    pages = [list(range(1, 2 + (len(prompt) + count) // PAGE))]
    logits, kv = run_step(model, caches(config, num_pages=len(pages[0]) + 1), [prompt], [0], pages)
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < count:
        logits, kv = run_step(model, kv, [tokens[-1:]], [len(prompt) + len(tokens) - 1], pages)
        tokens.append(int(np.argmax(logits[-1])))
    return tokens


# `make test-full`: the served model runs on the int4 kernel in make test (it says Paris, below),
# and each Linear packed for it computes what it does on XLA (tests/pallas_kernels/test_cpu_dense_int4.py).
@pytest.mark.slow
@pytest.mark.full
def test_native_int4_kernel_keeps_the_greedy_tokens_of_the_int8_held_path(model_dir, dense_kernels):
    """The embedded model as served on CPU (bfloat16, its Q4_1 blocks as int4 with an offset per
    32 inputs, packed for the native kernels) decodes the same greedy tokens with its projections
    on the native int4 kernel as with the same values held as int8 on the int8 kernel and the
    offsets' product on XLA (the path before the int4 kernel)."""
    on_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    unpacked = Preparation("bfloat16", quantization="int4z-g32")
    served = {}
    for int4 in (True, False):
        config, served[int4] = load_prepared(model_dir, unpacked, on_device)
        assert pack_for_native_dense(served[int4], int4=int4) > 0
    linears = [m for _, m in nnx.iter_modules(served[True]) if isinstance(m, Linear)]
    assert linears and all(isinstance(m.kernel, PackedKernel) for m in linears)
    assert all(is_packed_int4(m.kernel[...]) for m in linears)
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    prompt = tokenizer.encode("The capital of France is").ids
    on_int4 = _greedy_tokens(served[True], config, prompt, 12)
    assert on_int4 == _greedy_tokens(served[False], config, prompt, 12)
    assert "Paris" in tokenizer.decode(on_int4)


def test_unpermute_restores_rotate_half_order():
    import numpy as np

    # One head of dim 4 stored interleaved by llama.cpp as rows (r0, r2, r1, r3) -> (r0, r1, r2, r3).
    stored = np.array([[0.0], [2.0], [1.0], [3.0]])
    assert unpermute_rope_rows(stored, num_heads=1)[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.slow
def test_greedy_completion_says_paris(model_dir):
    llm = LLM(model=model_dir, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=PROMPT_STEP_TOKENS)
    assert_active()
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    del llm
    gc.collect()
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.slow
def test_fp8_kv_cache_holds_twice_the_tokens_and_still_says_paris(model_dir):
    """vLLM's kv_cache_dtype="fp8": float8 e4m3 values, one byte each, in the CPU's 128-token
    pages, so the same budget holds twice the tokens of a bfloat16 cache."""
    llm = LLM(
        model=model_dir,
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=PROMPT_STEP_TOKENS,
        kv_cache_dtype="fp8",
    )
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    cache = llm.llm_engine.vllm_config.cache_config
    num_blocks, block_size = cache.num_gpu_blocks, cache.block_size
    del llm
    gc.collect()
    assert block_size == 128
    layers, kv_heads, head_dim = 30, 3, 64
    page_bytes = 2 * kv_heads * head_dim * block_size * 1  # one byte a value
    assert num_blocks == int(read_env().cpu_kv_cache_gb * (1 << 30)) // (layers * page_bytes)
    assert "Paris" in out[0].outputs[0].text
