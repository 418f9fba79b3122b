# SPDX-License-Identifier: Apache-2.0
"""Gemma 4's mixture-of-experts block (`enable_moe_block`, gemma-4-26B-A4B's) on a tiny random
checkpoint written by transformers (the tiny Gemma 4 of tiny_checkpoints.py, with 8 experts of
32, top 2, beside every layer's dense MLP): the config's fields, the router's weights and
choices against transformers' router, the whole model's logits against transformers (a ragged
prefill of three prompts, then a mixed step), int8 experts equal to their dequantized model,
and the dense MLP's size among the dimensions a TP size must divide. On a mesh (TP=2, expert
parallel) and through `vllm.LLM`: test_gemma4_moe_on_mesh.py, test_gemma4_moe_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from models import ModelConfig, load_model
from models.gemma4 import Gemma4MoE
from models.linear import Linear
from models.loader import put_on_device
from models.moe import StackedLinear
from models.quantization import quantize_int8
from models.sharding import split_dimensions
from tests.models.test_int8 import _dequantized_copy
from tests.models.tiny_checkpoints import (
    assert_ragged_matches,
    caches,
    load_pair,
    prompts,
    run_step,
    save_tiny,
)

ARCH = "Gemma4ForCausalLM"
MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)


def save_tiny_gemma4_moe(path: str, *, seed: int = 0) -> str:
    """The tiny Gemma 4 with the MoE block in every layer."""
    return save_tiny(ARCH, path, seed=seed, **MOE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_gemma4_moe(str(tmp_path_factory.mktemp("gemma4_moe")))
    return (path, *load_pair(ARCH, path))


def test_config_reads_the_experts_and_refuses_a_block_without_them(tiny):
    _, config, _, _ = tiny
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert all(config.is_moe_layer(i) for i in range(config.num_layers))
    hf = {"architectures": [ARCH], "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128}
    hf.update(num_hidden_layers=2, num_attention_heads=4, head_dim=16, enable_moe_block=True)
    with pytest.raises(ValueError, match=r"lacks \['top_k_experts', 'moe_intermediate_size'\]"):
        ModelConfig.from_hf_dict({**hf, "num_experts": 8})
    dense = ModelConfig.from_hf_dict({**hf, "enable_moe_block": False, "num_experts": 8})
    assert dense.num_experts == 0  # experts named without the block: a dense model, as transformers builds it


def test_router_weights_and_choices_match_transformers(tiny):
    import torch

    _, config, model, hf = tiny
    x = np.random.default_rng(0).normal(size=(12, config.hidden_size)).astype(np.float32)
    for i in range(config.num_layers):
        moe = model.model.layers[i].moe
        assert isinstance(moe, Gemma4MoE)
        weights, experts = (np.asarray(a) for a in moe.select_experts(x))
        with torch.no_grad():
            _, hf_weights, hf_experts = hf.model.layers[i].router(torch.from_numpy(x))
        np.testing.assert_array_equal(np.sort(experts, -1), np.sort(hf_experts.numpy(), -1))
        order, hf_order = np.argsort(experts, -1), np.argsort(hf_experts.numpy(), -1)
        got = np.take_along_axis(weights, order, -1)
        want = np.take_along_axis(hf_weights.numpy(), hf_order, -1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # the per-expert scales make the weights sum to other than 1: the test sees them
        assert not np.allclose(weights.sum(-1), 1.0, atol=1e-3)


@pytest.mark.slow  # Gemma 4's module: its forward is test_architectures.py's; the router below stays fast
def test_ragged_prefill_then_mixed_decode_match_transformers(tiny):
    _, config, model, hf = tiny
    assert_ragged_matches(model, config, hf, [5, 16, 33])


@pytest.mark.slow  # two more loads and compiles of the model
def test_int8_experts_equal_their_dequantized_model(tiny):
    path, config, _, _ = tiny
    _, model = load_model(path, on_host=True)
    quantize_int8(model)
    routers = {id(layer.moe.router) for layer in model.model.layers}
    for _, module in nnx.iter_modules(model):
        if isinstance(module, (Linear, StackedLinear)):
            assert (module.kernel[...].dtype == np.int8) == (id(module) not in routers), module
    stacks = model.model.layers[0].moe.experts
    assert stacks.gate_proj.kernel_scale[...].shape == (8, 32)  # one scale per expert and column
    _, reference = load_model(path, on_host=True)
    quantize_int8(reference)
    _dequantized_copy(reference)
    put_on_device(model)
    put_on_device(reference)
    (ids,) = prompts([40], seed=3)
    got, _ = run_step(model, caches(config), [ids], [0], [[1, 2, 3]])
    expected, _ = run_step(reference, caches(config), [ids], [0], [[1, 2, 3]])
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)


def test_tensor_parallel_splits_the_dense_mlp_beside_the_experts(tiny):
    _, config, _, _ = tiny
    dimensions = dict(split_dimensions(config))
    assert dimensions["intermediate_size"] == 128  # every layer's dense MLP
    assert dimensions["experts' intermediate size"] == 32
    assert "experts' intermediate size" not in dict(split_dimensions(config, expert_parallel=True))


def gemma4_26b_parameters(layers: int) -> int:
    """gemma-4-26B-A4B's parameters in its first `layers` layers (every sixth full) with the
    embedding (tied) and the final norm, from its published shapes."""
    d, v, heads, f, e, moe_f = 2816, 262_144, 16, 2112, 128, 704
    total = v * d + d
    for i in range(layers):
        full = (i + 1) % 6 == 0
        h, kv = (512, 2) if full else (256, 8)
        q_and_o = 2 * d * heads * h
        k_and_v = d * kv * h * (1 if full else 2)  # full layers' keys are their values
        attention = q_and_o + k_and_v + 2 * h  # q_norm, k_norm
        moe = e * 3 * d * moe_f + d * e + d + e  # experts, router, its scale, per-expert scales
        total += attention + 3 * d * f + moe + 7 * d + 1  # dense MLP, norms, layer scalar
    return total


def test_shipped_planner_config_has_gemma_4_26b_a4b_s_layers_and_parameters():
    """tpu_platform/planner/model_configs/gemma-4-26b-a4b.json: 30 layers (every sixth full, head
    dim 512 and 2 KV heads, keys as values), 128 experts of 704 (8 a token) beside each dense MLP,
    and the 25.2B parameters its shapes add up to."""
    import jax
    import jax.numpy as jnp

    from models import build
    from tpu_platform.planner.plan import model_config

    config = model_config("gemma-4-26b-a4b")
    assert [i for i in range(30) if config.is_full(i)] == [5, 11, 17, 23, 29]
    assert (config.head_dim, config.num_kv_heads, config.attention_k_eq_v) == (512, 8, True)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 704)
    model = nnx.eval_shape(lambda: build(config, jnp.bfloat16))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(x.size for x in params) == gemma4_26b_parameters(30)
    assert gemma4_26b_parameters(30) == pytest.approx(25.2e9, rel=0.005)  # the model card's count
