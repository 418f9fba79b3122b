# SPDX-License-Identifier: Apache-2.0
"""Tiny random GLM-4.5 (`Glm4MoeForCausalLM`) checkpoints, one per variant of attention and
routing (tests/models/test_glm4_moe.py lists what each exercises)."""

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
    num_key_value_heads=2,
    head_dim=16,
    attention_bias=True,
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
# variant -> overrides of _COMMON
VARIANTS = {
    # GLM-4.5's shape: q/k norms, 4 groups of which 2 are kept, normalized and scaled weights.
    "qk_norm": dict(
        use_qk_norm=True, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5
    ),
    # GLM-4.5-Air's: no q/k norm; here 2 groups, 1 kept, weights neither normalized nor scaled,
    # and another RoPE base.
    "no_qk_norm": dict(
        use_qk_norm=False,
        n_group=2,
        topk_group=1,
        norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
    ),
}


def save_tiny_glm4_moe(variant: str, path: str, *, seed: int = 0, **overrides: object) -> str:
    """A random tiny GLM-4.5 checkpoint (fp32 safetensors, larger init than HF's so greedy text
    varies; norms, biases and the router's correction bias moved off their 0/1 init)."""
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    save_tokenizer(path, vocab_size=VOCAB)
    config = transformers.Glm4MoeConfig(**{**_COMMON, **VARIANTS[variant], **overrides})
    config.architectures = ["Glm4MoeForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(config).to(torch.float32)
    spread_parameters(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path
