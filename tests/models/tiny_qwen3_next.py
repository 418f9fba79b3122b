# SPDX-License-Identifier: Apache-2.0
"""Tiny random Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5 (`Qwen3_5ForCausalLM`,
`Qwen3_5MoeForCausalLM`) checkpoints: three Gated DeltaNet layers and one gated full-attention
layer (transformers' default pattern), grouped key heads (2 key heads for 4 value heads), a
quarter of each attention head rotated; Qwen3-Next routes to experts beside a shared expert in
every layer but one dense one (`mlp_only_layers`), Qwen3.5-MoE in every layer, Qwen3.5 never."""

from __future__ import annotations

import os

from tests.models.tiny_checkpoints import VOCAB
from tests.tiny_models import save_tokenizer

FIELDS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    mlp_only_layers=[1],
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


_MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
# architecture -> (transformers config class, its fields)
ARCHITECTURES = {
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", FIELDS),
    "Qwen3_5ForCausalLM": (
        "Qwen3_5TextConfig",
        {k: v for k, v in FIELDS.items() if k not in (*_MOE_FIELDS, "mlp_only_layers")},
    ),
    "Qwen3_5MoeForCausalLM": (
        "Qwen3_5MoeTextConfig",
        {k: v for k, v in FIELDS.items() if k not in ("intermediate_size", "mlp_only_layers")},
    ),
}


def save_tiny_qwen3_next(
    path: str, *, seed: int = 0, architecture: str = "Qwen3NextForCausalLM", **overrides: object
) -> str:
    """The checkpoint (fp32 safetensors) and a tokenizer; weights re-drawn larger than HF's init so
    greedy text varies, norms and per-head scalars moved off their init so a wrong mapping shows.
    `overrides`: config fields other than `FIELDS`'."""
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    save_tokenizer(path, vocab_size=VOCAB)
    config_class, fields = ARCHITECTURES[architecture]
    config = getattr(transformers, config_class)(**{**fields, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decays between exp(-0.5) and exp(-4) a token at a = 0
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0))
            elif p.dim() >= 2:
                p.normal_(0.0, 0.3)
            else:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path
