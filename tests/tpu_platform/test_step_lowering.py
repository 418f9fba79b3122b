# SPDX-License-Identifier: Apache-2.0
"""The whole jitted model step lowers for TPU (Mosaic) and CUDA (Triton) with each Pallas backend.

No device is needed: `jax.export` runs the Pallas lowerings for the target platform. The model
is the runner's real forward program (Llama layers, KV write, ragged attention, LM head).
The kernels themselves are compiled by the real TPU and GPU compilers in
tests/aot/test_compile_kernels_*.py, and real-size steps in tests/aot/test_model_step*.py; what
export adds here: the step's lowering (a float8 cache's casts included) checked in the ordinary
test process, without the compile toolchains, on a model small enough to trace in seconds.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import pallas_kernels.backend
from models import ModelConfig, build
from tpu_platform.inputs import pack_inputs, padding_inputs
from tpu_platform.kv_cache import allocate_stacked_caches
from tpu_platform.step import make_forward

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
)  # fmt: skip
CASES = [("pallas_tpu", "tpu", "tpu_custom_call"), ("pallas_gpu", "cuda", "__gpu$xla.gpu.triton")]


@pytest.mark.parametrize(("backend", "platform", "custom_call"), CASES)
@pytest.mark.parametrize(("num_tokens", "kv_dtype", "page_size"), [
    (1, "bfloat16", 16), (64, "bfloat16", 16), (64, "float8_e4m3fn", 32),
])  # fmt: skip
def test_model_step_lowers(monkeypatch, backend, platform, custom_call, num_tokens, kv_dtype, page_size):
    # Backend selection checks the device kind; here the device is the export target.
    monkeypatch.setattr(pallas_kernels.backend, "default_platform", lambda: platform)
    graphdef, state = nnx.split(build(CONFIG, jnp.bfloat16))
    # The runner's caches: every layer's in one array.
    caches = allocate_stacked_caches(
        CONFIG.num_layers, 256, page_size, CONFIG.num_kv_heads, CONFIG.head_dim, kv_dtype, backend
    )
    packed, dims = pack_inputs(padding_inputs(num_tokens, min(num_tokens, 8), 32))
    leaves, state_def = jax.tree.flatten(state)
    fed_tokens = jnp.zeros(8, jnp.int32)  # the previous step's tokens (max_num_seqs wide)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (leaves, caches, packed, fed_tokens)
    )
    disabled = [jax.export.DisabledSafetyCheck.custom_call(custom_call)]
    exported = jax.export.export(
        make_forward(graphdef, state_def, backend, kv_dtype=kv_dtype, cache_pages=256),
        platforms=[platform],
        disabled_checks=disabled,
    )(*abstract, dims=dims)
    assert custom_call in exported.mlir_module()
