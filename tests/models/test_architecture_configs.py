# SPDX-License-Identifier: Apache-2.0
"""Architecture-specific checks on the tiny checkpoints: per-layer sliding windows, legacy
config.json spellings, expert stacking and dense/sparse layer mixes. Logit and greedy parity of
every architecture is in test_architectures.py."""

import json
import os

import pytest
from safetensors.numpy import load_file, save_file

from models import ModelConfig, build, load_weights
from models.layers import GatedMLP
from models.moe import SparseMoE
from tests.models.tiny_checkpoints import (
    assert_prefill_matches,
    load_pair,
    save_tiny,
    save_tiny_llama4_multimodal,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """`tiny(arch)` -> (path, config, model, hf), each architecture built once."""
    built = {}

    def get(arch):
        if arch not in built:
            path = save_tiny(arch, str(tmp_path_factory.mktemp(arch)))
            built[arch] = (path, *load_pair(arch, path))
        return built[arch]

    return get


def _hf_config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def test_mistral_every_layer_slides(tiny):
    _, config, _, _ = tiny("MistralForCausalLM")
    assert config.layer_sliding_windows == (12, 12) and config.sliding_window == 12


def test_mixtral_experts_stack_per_layer(tiny):
    _, config, model, _ = tiny("MixtralForCausalLM")
    assert (config.num_experts, config.num_experts_per_tok, config.intermediate_size) == (8, 2, 64)
    assert model.model.layers[0].mlp.experts.gate_proj.kernel[...].shape == (8, 64, 64)  # [E, D, F]
    assert model.model.layers[1].mlp.experts.down_proj.kernel[...].shape == (8, 64, 64)  # [E, F, D]


def test_mixtral_missing_expert_is_named(tiny, tmp_path):
    path, config, _, _ = tiny("MixtralForCausalLM")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"lacks experts \[5\] of 'model.layers.1.mlp.experts.up_proj.kernel'"
    ):
        load_weights(build(config), str(tmp_path))


def test_qwen2_sliding_window_top_layers_match_transformers(tmp_path):
    # use_sliding_window with max_window_layers=1: layer 0 full, layer 1 sliding (window 8 < 37 tokens).
    arch = "Qwen2ForCausalLM"
    path = save_tiny(arch, str(tmp_path), use_sliding_window=True, sliding_window=8, max_window_layers=1)
    config, model, hf = load_pair(arch, path)
    assert config.layer_sliding_windows == (None, 8) and config.sliding_window is None
    assert_prefill_matches(model, config, hf, 37)


def test_qwen2_unused_sliding_window_is_ignored(tiny):
    arch = "Qwen2ForCausalLM"
    _, config, _, _ = tiny(arch)
    assert config.layer_sliding_windows == (None, None)
    hf = {"architectures": [arch], "model_type": "qwen2", "vocab_size": 8, "hidden_size": 8,
          "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
          "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 1}  # fmt: skip
    assert ModelConfig.from_hf_dict(hf).layer_sliding_windows == (None, None)


def test_qwen3_moe_sparse_and_dense_layers(tiny):
    _, config, model, _ = tiny("Qwen3MoeForCausalLM")
    assert [config.is_moe_layer(i) for i in range(3)] == [True, False, True]
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoE, GatedMLP, SparseMoE]
    assert not model.model.layers[0].mlp.renormalize


def test_gemma2_layer_windows_alternate(tiny):
    path, config, _, _ = tiny("Gemma2ForCausalLM")
    assert config.layer_sliding_windows == (10, None) and config.sliding_window is None
    assert (config.attn_logit_softcap, config.final_logit_softcap, config.query_pre_attn_scalar) == (5, 5, 24)
    legacy = _hf_config(path)
    del legacy["layer_types"]  # configs written before `layer_types`: even layers slide
    assert ModelConfig.from_hf_dict(legacy) == config


def test_gemma3_layer_windows_and_rope(tiny):
    path, config, _, _ = tiny("Gemma3ForCausalLM")
    assert config.layer_sliding_windows == (10, None, 10) and config.sliding_window is None
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling.factor) == (20000, 1000, 2)
    # The same model as a pre-transformers-5 config.json describes it.
    legacy = _hf_config(path)
    for key in ("layer_types", "rope_parameters"):
        del legacy[key]
    legacy.update(
        sliding_window_pattern=2,
        rope_theta=20000.0,
        rope_local_base_freq=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    assert ModelConfig.from_hf_dict(legacy) == config


def test_gpt_oss_config_alternates_windows_and_reads_the_swiglu(tiny):
    _, config, model, _ = tiny("GptOssForCausalLM")
    assert config.layer_sliding_windows == (6, None)
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 2.0)
    assert config.rope_scaling.rope_type == "yarn" and config.rope_scaling.truncate is False
    layer = model.model.layers[0]
    assert layer.self_attn.sinks[...].shape == (4,)
    assert layer.mlp.experts.gate_up_proj[...].shape == (8, 64, 64)  # [E, D, 2F]


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("scaling", [dict(factor=32.0), dict(factor=4.0, mscale=0.707, mscale_all_dim=1.0)])
def test_yarn_frequencies_and_attention_factor_match_transformers(truncate, scaling):
    import numpy as np
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models.rope import Rope

    params = {"rope_type": "yarn", "rope_theta": 150000.0, "original_max_position_embeddings": 4096}
    params.update(scaling, truncate=truncate)
    hf = transformers.GptOssConfig(head_dim=64, max_position_embeddings=131072, rope_parameters=params)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    config = ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["GptOssForCausalLM"]})
    rope = Rope(config.rope_theta, config.rope_scaling)
    np.testing.assert_allclose(rope.inverse_frequencies(64), inv_freq.numpy(), rtol=1e-6)
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)


def test_llama4_config_reads_its_layer_kinds_and_sizes(tiny):
    _, config, model, _ = tiny("Llama4ForCausalLM")
    # no_rope_layers [1, 1, 1, 0]: three RoPE layers chunked by 8, a global NoPE layer.
    assert config.rope_layers == (True, True, True, False)
    assert config.layer_attention_chunks == (8, 8, 8, None)
    # interleave_moe_layer_step 2: layers 1 and 3 MoE (experts of 32), 0 and 2 dense (MLP of 64).
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert (config.intermediate_size, config.moe_intermediate_size) == (64, 32)
    moe = model.model.layers[1].mlp
    assert moe.experts.gate_proj.kernel[...].shape == (4, 64, 32)  # [E, D, F] from gate_up_proj
    assert moe.experts.down_proj.kernel[...].shape == (4, 32, 64)
    assert isinstance(model.model.layers[2].mlp, GatedMLP)


@pytest.mark.slow  # a second Llama 4 checkpoint, with a vision tower, built and loaded
def test_llama4_multimodal_checkpoint_serves_its_text_model(tmp_path):
    path = save_tiny_llama4_multimodal(str(tmp_path))
    assert any(
        name.startswith("vision_model.") for name in load_file(os.path.join(path, "model.safetensors"))
    )
    config, model, hf = load_pair("Llama4ForConditionalGeneration", path)
    assert config.architecture == "Llama4ForConditionalGeneration"
    assert config.layer_attention_chunks == (8, 8, 8, None)
    assert_prefill_matches(model, config, hf, 37)  # text-only inputs: transformers' logits
