# SPDX-License-Identifier: Apache-2.0
"""Tiny targets with drafters whose drafts are often kept, for tests that must see drafts
accepted (a random EAGLE-3 head or MTP layer drafts tokens the target rarely agrees with).

The target's layers are damped (every attention and MLP output projection scaled down, as
`tests.tiny_models.save_damped_tiny_llama` does): its next token is then close to a function of
the current token alone, `argmax(lm_head(norm(embed(token))))`, while every layer still moves
the logits (some drafts fail). The drafter is built to compute that function of the token it is
given: an MTP layer whose `eh_proj` passes the embedding half through, a damped block, and the
target's final norm and head; an EAGLE-3 head whose attention copies each position's token
embedding (queries and keys the embedding, sharpened, so a position attends to itself or to the
same token) with a zero MLP and the target's final norm and head.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from tests.models.tiny_deepseek import save_tiny_deepseek_mtp
from tests.tiny_models import save_tiny_eagle3_head, save_tiny_llama

DAMPING = 0.002
# Queries scaled so that a position's attention score with itself (the embedding's squared
# norm over the head's width) stands far above its score with another token's embedding.
SHARPNESS = 8.0


def _damp(tensors: dict, scale: float) -> None:
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.mul_(scale)


def save_damped_llama_with_eagle3_head(target_dir: str, head_dir: str, *, seed: int) -> tuple[str, str]:
    """A damped tiny Llama (as many KV heads as query heads: the head's values copy the whole
    embedding) and an EAGLE-3 head that drafts its damped next token; returns both paths."""
    save_tiny_llama(target_dir, seed=seed, num_key_value_heads=4, num_attention_heads=4)
    file = os.path.join(target_dir, "model.safetensors")
    target = load_file(file)
    _damp(target, DAMPING)
    save_file(target, file, metadata={"format": "pt"})
    save_tiny_eagle3_head(head_dir, target_dir, seed=seed + 1, aux_layer_ids=(0, 1, 2))
    head_file = os.path.join(head_dir, "model.safetensors")
    head = load_file(head_file)
    d = target["model.norm.weight"].shape[0]
    embed_half = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)  # [d, 2d]: reads the embedding
    head.update({
        "fc.weight": torch.zeros_like(head["fc.weight"]),
        "midlayer.input_layernorm.weight": torch.ones(d),
        "midlayer.hidden_norm.weight": torch.ones(d),
        "midlayer.post_attention_layernorm.weight": torch.ones(d),
        "midlayer.self_attn.q_proj.weight": SHARPNESS * embed_half,
        "midlayer.self_attn.k_proj.weight": embed_half.clone(),
        "midlayer.self_attn.v_proj.weight": embed_half.clone(),
        "midlayer.self_attn.o_proj.weight": torch.eye(d),
        "midlayer.mlp.down_proj.weight": torch.zeros_like(head["midlayer.mlp.down_proj.weight"]),
        "norm.weight": target["model.norm.weight"].clone(),
        "lm_head.weight": target["lm_head.weight"].clone(),
    })  # fmt: skip
    save_file({name: t.contiguous() for name, t in head.items()}, head_file)
    return target_dir, head_dir


def save_damped_deepseek_with_mtp_layer(path: str, *, seed: int) -> str:
    """A damped tiny DeepSeek-V3 whose MTP layer drafts its damped next token; returns path."""
    save_tiny_deepseek_mtp(path, seed=seed)
    with open(os.path.join(path, "config.json")) as f:
        layer = f"model.layers.{json.load(f)['num_hidden_layers']}."
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    _damp(tensors, DAMPING)
    d = tensors["model.norm.weight"].shape[0]
    tensors.update({
        f"{layer}enorm.weight": torch.ones(d),
        f"{layer}eh_proj.weight": torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1),
        f"{layer}shared_head.norm.weight": tensors["model.norm.weight"].clone(),
        f"{layer}shared_head.head.weight": tensors["lm_head.weight"].clone(),
    })  # fmt: skip
    save_file({name: t.contiguous() for name, t in tensors.items()}, file, metadata={"format": "pt"})
    return path
