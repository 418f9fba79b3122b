# SPDX-License-Identifier: Apache-2.0
"""Tiny random DeepSeek-V2 / V3 checkpoints, one per variant of attention and routing
(tests/models/test_deepseek.py lists what each exercises)."""

from __future__ import annotations

import os

from tests.models.tiny_checkpoints import VOCAB, spread_parameters
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
    "v2_lite_greedy": (
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        dict(q_lora_rank=None, topk_method="greedy"),
    ),
    "v2_group_limited": (
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        dict(
            q_lora_rank=24,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=1,
            routed_scaling_factor=2.0,
        ),
    ),
    "v3_noaux_yarn": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            q_lora_rank=24,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=YARN,
        ),
    ),
    "v3_rope_halves": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(q_lora_rank=24, n_group=1, topk_group=1, rope_interleave=False, first_k_dense_replace=0),
    ),
}


def save_tiny_deepseek(variant: str, path: str, *, seed: int = 0, **overrides: object) -> str:
    """A random tiny DeepSeek checkpoint (fp32 safetensors, larger init than HF's so greedy text
    varies; norms, biases and the router's correction bias moved off their 0/1 init), its
    config `variant`'s with `overrides`."""
    architecture, config_class, config = VARIANTS[variant]
    return _save(architecture, config_class, {**config, **overrides}, path, seed=seed)


def _save(architecture: str, config_class: str, overrides: dict, path: str, *, seed: int) -> str:
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    save_tokenizer(path, vocab_size=VOCAB)
    config = getattr(transformers, config_class)(**{**_COMMON, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    spread_parameters(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


# Values a token takes in a layer's latent cache: kv_lora_rank + qk_rope_head_dim.
LATENT_WIDTH = _COMMON["kv_lora_rank"] + _COMMON["qk_rope_head_dim"]


# Kimi K2 ships `DeepseekV3ForCausalLM` weights under `model_type: kimi_k2` (vLLM reads it as a
# DeepSeek-V3 config), with one expert group, YaRN of beta 1/1 and mscale 1/1 in the older
# `rope_scaling` spelling, and its routed scaling factor.
KIMI_K2_ROPE_SCALING = {
    "type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
KIMI_K2 = dict(q_lora_rank=24, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827)


def save_tiny_kimi_k2(path: str, *, seed: int = 0) -> str:
    """A tiny DeepSeek-V3 checkpoint whose config.json reads as Kimi K2's does."""
    import json

    _save("DeepseekV3ForCausalLM", "DeepseekV3Config", KIMI_K2, path, seed=seed)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.pop("rope_parameters", None)
    config.update(
        model_type="kimi_k2",
        rope_theta=50000.0,
        rope_scaling=KIMI_K2_ROPE_SCALING,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return path


def save_tiny_deepseek_mtp(path: str, *, seed: int = 0, **overrides: object) -> str:
    """A tiny DeepSeek-V3 checkpoint (`v3_noaux_yarn`'s, with `overrides`) with one
    multi-token-prediction layer stored after its last layer, as DeepSeek-V3's is
    (`with_mtp_layer`): its block is latent attention and MoE."""
    architecture, config_class, variant = VARIANTS["v3_noaux_yarn"]
    layers = _COMMON["num_hidden_layers"]
    overrides = {**variant, **overrides, "num_hidden_layers": layers + 1}
    _save(architecture, config_class, overrides, path, seed=seed)
    return with_mtp_layer(path, seed=seed)


def with_mtp_layer(path: str, *, seed: int) -> str:
    """The checkpoint at `path`, saved by transformers with one decoder layer more than it will
    have (transformers drops MTP layers, so the MTP layer's block is saved as that last layer),
    written back with one layer less, `num_nextn_predict_layers: 1`, the MTP layer's own random
    tensors (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head`) and a copy of
    the embedding under its name (which the MTP layer shares with the target)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    layers, d = config["num_hidden_layers"] - 1, config["hidden_size"]
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    prefix = f"model.layers.{layers}."
    generator = torch.Generator().manual_seed(seed + 1)

    def normal(*shape, std=0.3):
        return torch.randn(*shape, generator=generator) * std

    tensors.update({
        f"{prefix}enorm.weight": 1.0 + normal(d, std=0.2),
        f"{prefix}hnorm.weight": 1.0 + normal(d, std=0.2),
        f"{prefix}eh_proj.weight": normal(d, 2 * d),
        f"{prefix}shared_head.norm.weight": 1.0 + normal(d, std=0.2),
        f"{prefix}shared_head.head.weight": normal(config["vocab_size"], d),
        f"{prefix}embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    })  # fmt: skip
    save_file(tensors, file, metadata={"format": "pt"})
    return path
