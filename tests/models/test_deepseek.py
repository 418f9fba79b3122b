# SPDX-License-Identifier: Apache-2.0
"""Tiny random DeepSeek-V2 and V3 checkpoints against transformers fp32: logits at every position
of a prefill and of a ragged batch (prefills, then decodes and a 2-token chunk), one checkpoint per
routing variant:

- V2-Lite's shape: full-rank queries, softmax greedy top-k, a dense first layer;
- V2 with low-rank queries and group-limited greedy routing (4 groups, the best 2 kept) and a
  routed scaling factor;
- V3: low-rank queries, sigmoid scores with a (random, non-zero) correction bias, group top-k,
  normalized weights, routed scaling, YaRN RoPE with DeepSeek's mscale (both factors differ from
  1), interleaved rope dimensions;
- V3 with rope dimensions rotated as halves (`rope_interleave=False`).

Plus the config's parsing and the MTP layers a checkpoint carries being skipped on load.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from models import ModelConfig, load_model
from models.deepseek_config import DeepseekConfig
from models.rope import YarnScaling
from tests.models.tiny_checkpoints import (
    VOCAB,
    assert_prefill_matches,
    assert_ragged_matches,
    hf_logits,
    prompts,
)
from tests.tiny_models import save_tokenizer

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
# variant -> (architecture, transformers config class, overrides of _COMMON)
VARIANTS = {
    "v2_lite_greedy": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(q_lora_rank=None, topk_method="greedy")),
    "v2_group_limited": (
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0),
    ),
    "v3_noaux_yarn": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
             rope_parameters=YARN),
    ),  # fmt: skip
    "v3_rope_halves": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(q_lora_rank=24, n_group=1, topk_group=1, rope_interleave=False, first_k_dense_replace=0),
    ),
}


def save_tiny_deepseek(variant: str, path: str, *, seed: int = 0) -> str:
    """A random tiny DeepSeek checkpoint (fp32 safetensors, larger init than HF's so greedy text
    varies; norms, biases and the router's correction bias moved off their 0/1 init)."""
    import torch
    import transformers

    architecture, config_class, overrides = VARIANTS[variant]
    os.makedirs(path, exist_ok=True)
    save_tokenizer(path, vocab_size=VOCAB)
    config = getattr(transformers, config_class)(**{**_COMMON, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
            else:
                p.add_(torch.randn_like(p) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    """(variant, path, config, model, hf), built once per variant."""
    import torch
    import transformers

    variant = request.param
    path = save_tiny_deepseek(variant, str(tmp_path_factory.mktemp(variant)))
    config, model = load_model(path)
    hf = getattr(transformers, VARIANTS[variant][0]).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return variant, path, config, model, hf.eval()


def test_prefill_logits_match_transformers(tiny):
    _, _, config, model, hf = tiny
    assert_prefill_matches(model, config, hf, 37)


def test_ragged_prefill_then_mixed_decode_match_transformers(tiny):
    _, _, config, model, hf = tiny
    assert_ragged_matches(model, config, hf, [5, 16, 33])


def test_config_reads_latent_attention_and_routing(tiny):
    variant, path, config, _, _ = tiny
    assert isinstance(config, DeepseekConfig)
    assert config.latent_cache_width == 32 + 8
    assert config.head_dim == 16 + 8
    assert [config.is_moe_layer(i) for i in range(3)] == (
        [True] * 3 if variant == "v3_rope_halves" else [False, True, True]
    )
    expected = {
        "v2_lite_greedy": ("greedy", "softmax", None),
        "v2_group_limited": ("group_limited_greedy", "softmax", 24),
        "v3_noaux_yarn": ("noaux_tc", "sigmoid", 24),
        "v3_rope_halves": ("noaux_tc", "sigmoid", 24),
    }[variant]
    assert (config.topk_method, config.scoring_func, config.q_lora_rank) == expected
    assert (config.yarn is not None) == (variant == "v3_noaux_yarn")
    with open(os.path.join(path, "config.json")) as f:
        assert ModelConfig.from_hf_dict(json.load(f)) == config


def test_yarn_frequencies_and_mscale_match_transformers():
    import torch
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = DeepseekV3Config(**{**_COMMON, "rope_parameters": YARN})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, torch.device("cpu"))
    yarn = DeepseekConfig.from_hf_dict({**hf_config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}).yarn
    assert isinstance(yarn, YarnScaling)
    np.testing.assert_allclose(yarn.inverse_frequencies(8, 10000.0), inv_freq.numpy(), rtol=1e-6)
    assert yarn.rope_scale == pytest.approx(attention_factor)
    # transformers' softmax scale: qk_head_dim ** -0.5 * mscale(factor, mscale_all_dim) ** 2
    assert yarn.softmax_scale == pytest.approx((0.1 * 0.8 * np.log(4.0) + 1.0) ** 2)


def test_multi_token_prediction_layer_is_skipped_on_load(tmp_path):
    # A checkpoint with one more layer than num_hidden_layers says (as V3's MTP layer is stored).
    import torch
    from safetensors.torch import load_file, save_file

    path = save_tiny_deepseek("v2_lite_greedy", str(tmp_path / "ckpt"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(4 * 28, 32)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config, model = load_model(path)
    (ids,) = prompts([9])
    import transformers

    hf = transformers.DeepseekV2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert config.num_layers == 3
    assert hf_logits(hf, ids).shape == (9, VOCAB)
    assert_prefill_matches(model, config, hf, 9)
