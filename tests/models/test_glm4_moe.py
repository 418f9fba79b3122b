# SPDX-License-Identifier: Apache-2.0
"""Tiny random GLM-4.5 checkpoints against transformers fp32: logits at every position of a
prefill and of a ragged batch (prefills, then decodes and a 2-token chunk), one checkpoint per
variant, each with biases on q/k/v, RoPE on the first half of each head, a dense first layer
(`first_k_dense_replace=1`), then sigmoid group routing with a (random, non-zero) correction
bias and a shared expert:

- `qk_norm` (GLM-4.5's shape): q/k RMSNorm, 4 groups of which 2 are kept, normalized weights,
  a routed scaling factor;
- `no_qk_norm` (GLM-4.5-Air's): no q/k norm, 2 groups of which 1 is kept, weights neither
  normalized nor scaled, another RoPE base given in `rope_parameters`.

Plus the config's parsing (GLM-4.5-Air's published `config.json`), the partial rotation's
tables, and the multi-token-prediction layer a checkpoint carries being skipped on load.
"""

from __future__ import annotations

import json
import os
from importlib import resources

import numpy as np
import pytest

from models import ModelConfig, attach_rope_tables, load_model
from models.glm4_moe import Glm4MoeConfig
from tests.models.tiny_checkpoints import assert_prefill_matches, assert_ragged_matches
from tests.models.tiny_glm4_moe import VARIANTS, save_tiny_glm4_moe
from tpu_platform.planner.abstract_weights import abstract_model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    """(variant, path, config, model, hf), built once per variant."""
    import torch
    import transformers

    variant = request.param
    path = save_tiny_glm4_moe(variant, str(tmp_path_factory.mktemp(variant)))
    config, model = load_model(path)
    hf = transformers.Glm4MoeForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return variant, path, config, model, hf.eval()


# The fast tier's prefill with q/k norms is the ragged one through RoPE tables below (it checks every
# position of three prefills); the prefill with computed rotations runs on the other variant.
@pytest.mark.parametrize(
    "tiny", ["no_qk_norm", pytest.param("qk_norm", marks=pytest.mark.slow)], indirect=True
)
def test_prefill_logits_match_transformers(tiny):
    _, _, config, model, hf = tiny
    assert_prefill_matches(model, config, hf, 37)


# The fast tier runs the ragged batch through RoPE tables (the runner's path) on one variant.
@pytest.mark.slow
def test_ragged_prefill_then_mixed_decode_match_transformers(tiny):
    _, _, config, model, hf = tiny
    assert_ragged_matches(model, config, hf, [5, 16, 33])


@pytest.mark.slow  # the fast tier's GLM forward is the prefill above, on the variant without q/k norms
@pytest.mark.parametrize("tiny", ["qk_norm"], indirect=True)
def test_partial_rotations_from_rope_tables_match_transformers(tiny):
    # What the runner runs: one table of the rotated dimensions' cosines and sines (8 of 16).
    _, path, _, _, hf = tiny
    config, model = load_model(path)
    assert attach_rope_tables(model, 64) == 1
    assert model.model.layers[0].self_attn.rope_table[...].shape == (64, 8)
    assert_ragged_matches(model, config, hf, [5, 16, 33])


# The fast tier builds the one variant it runs a forward on.
@pytest.mark.parametrize(
    "tiny", ["no_qk_norm", pytest.param("qk_norm", marks=pytest.mark.slow)], indirect=True
)
def test_config_reads_attention_and_routing(tiny):
    variant, path, config, model, _ = tiny
    assert isinstance(config, Glm4MoeConfig)
    assert (config.rotary_dim, config.latent_cache_width) == (8, 0)
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert (config.topk_method, config.scoring_func, config.n_shared_experts) == ("noaux_tc", "sigmoid", 1)
    expected = {"qk_norm": (True, 4, 2, 2.5), "no_qk_norm": (False, 2, 1, 1.0)}[variant]
    assert (config.use_qk_norm, config.n_group, config.topk_group, config.routed_scaling_factor) == expected
    attention = model.model.layers[1].self_attn
    assert (attention.q_norm is not None) == config.use_qk_norm
    assert attention.o_proj.bias is None and attention.qkv_proj.bias is not None
    with open(os.path.join(path, "config.json")) as f:
        assert ModelConfig.from_hf_dict(json.load(f)) == config


@pytest.mark.slow  # the abstract 106B model's shapes take seconds to trace
def test_glm_4_5_air_config_parses_as_published():
    text = resources.files("tpu_platform.planner").joinpath("model_configs", "glm-4.5-air.json").read_text()
    config = ModelConfig.from_hf_dict(json.loads(text))
    assert isinstance(config, Glm4MoeConfig)
    assert (config.head_dim, config.rotary_dim, config.rope_theta) == (128, 64, 1e6)
    assert (config.num_heads, config.num_kv_heads, config.attention_bias) == (96, 8, True)
    assert not config.use_qk_norm
    assert (config.num_experts, config.num_experts_per_tok, config.n_shared_experts) == (128, 8, 1)
    assert [config.is_moe_layer(i) for i in (0, 1, 45)] == [False, True, True]
    # Model card: 106B parameters (its multi-token-prediction layer aside): 106.85B exactly.
    weights = abstract_model(config, "bfloat16", 2048).weight_bytes
    assert abs(weights / 2e9 - 106.85) < 0.01, weights


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(partial_rotary_factor=0.3), r"partial_rotary_factor 0.3 of head_dim 16"),
        (dict(n_group=3), r"8 experts in n_group=3 groups"),
    ],
)
def test_impossible_configs_are_refused_by_name(fields, message):
    from tests.models.tiny_glm4_moe import _COMMON

    hf = {**_COMMON, "architectures": ["Glm4MoeForCausalLM"], **fields}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(hf)


def test_multi_token_prediction_layer_is_skipped_on_load(tmp_path):
    # A checkpoint with one more layer than num_hidden_layers says, as GLM-4.5 stores its MTP layer.
    import torch
    from safetensors.torch import load_file, save_file

    path = save_tiny_glm4_moe("no_qk_norm", str(tmp_path / "ckpt"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.3.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.shared_head.head.weight"] = torch.zeros(384, 64)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config, model = load_model(path, on_host=True)
    assert config.num_layers == len(model.model.layers) == 3
    kernel = np.asarray(model.model.layers[2].self_attn.o_proj.kernel[...])
    np.testing.assert_array_equal(kernel, tensors["model.layers.2.self_attn.o_proj.weight"].numpy().T)


def test_bfloat16_router_chooses_and_weighs_as_transformers_float32_router():
    # Served in bfloat16, the router's logits stay float32 products, as transformers (and vLLM)
    # compute them: rounded to bfloat16, the weights move by ~1e-3 and near ties change experts.
    import jax.numpy as jnp
    import torch
    import transformers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from models.deepseek_moe import DeepseekMoE
    from tests.models.tiny_glm4_moe import _COMMON

    fields = {**_COMMON, **VARIANTS["qk_norm"], "routed_scaling_factor": 1.0}
    config = ModelConfig.from_hf_dict({**fields, "architectures": ["Glm4MoeForCausalLM"]})
    moe = DeepseekMoE(config, dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    kernel = jnp.asarray(rng.normal(0, 0.3, (64, 8)), jnp.bfloat16)  # [D, E]
    bias = rng.normal(0, 0.2, 8).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(64, 64)), jnp.bfloat16)
    moe.router.kernel.set_value(kernel)
    moe.e_score_correction_bias.set_value(jnp.asarray(bias))
    weights, experts = moe.select_experts(x)

    hf = Glm4MoeTopkRouter(transformers.Glm4MoeConfig(**fields))
    with torch.no_grad():
        hf.weight.copy_(torch.tensor(np.asarray(kernel, np.float32).T))
        hf.e_score_correction_bias.copy_(torch.tensor(bias))
        _, hf_weights, hf_experts = hf(torch.tensor(np.asarray(x, np.float32)))
    order, hf_order = np.argsort(np.asarray(experts), axis=1), np.argsort(hf_experts.numpy(), axis=1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(experts), order, 1), np.take_along_axis(hf_experts.numpy(), hf_order, 1)
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), order, 1),
        np.take_along_axis(hf_weights.numpy(), hf_order, 1),
        rtol=1e-5,
    )
