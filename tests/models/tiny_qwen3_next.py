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
    _redraw(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def save_tiny_qwen3_next_mtp(path: str, *, seed: int = 0, architecture: str = "Qwen3NextForCausalLM") -> str:
    """A tiny checkpoint of `architecture` with one multi-token-prediction layer (`mtp.*`, as
    Qwen3-Next's and Qwen3.5's are stored). transformers drops MTP layers, so the layer's block
    is saved as a fifth, full-attention decoder layer, then written back as `mtp.layers.0.*` with
    the layer's own random tensors (`fc`, its three norms) and `mtp_num_hidden_layers: 1`."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    layers = FIELDS["num_hidden_layers"]
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    save_tiny_qwen3_next(
        path, seed=seed, architecture=architecture, num_hidden_layers=layers + 1,
        layer_types=[*types, "full_attention"],
    )  # fmt: skip
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(num_hidden_layers=layers, layer_types=types, mtp_num_hidden_layers=1)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    file = os.path.join(path, "model.safetensors")
    block = f"model.layers.{layers}."
    tensors = {
        ("mtp.layers.0." + k.removeprefix(block) if k.startswith(block) else k): v
        for k, v in load_file(file).items()
    }
    generator = torch.Generator().manual_seed(seed + 1)
    d = FIELDS["hidden_size"]
    tensors.update({
        "mtp.fc.weight": torch.randn(d, 2 * d, generator=generator) * 0.2,
        **{
            f"mtp.{norm}.weight": torch.randn(d, generator=generator) * 0.2
            for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
        },
    })  # fmt: skip
    save_file(tensors, file, metadata={"format": "pt"})
    return path


# multimodal architecture -> (transformers' vision and whole config classes, the text model's class)
RELEASED = {
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5VisionConfig", "Qwen3_5Config", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": (
        "Qwen3_5MoeVisionConfig",
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForCausalLM",
    ),
}


def save_tiny_qwen3_5_multimodal(path: str, architecture: str, *, seed: int = 0) -> str:
    """A random tiny Qwen3.5 text model (`tiny_qwen3_next`'s fields) under a small vision tower,
    saved by transformers' multimodal class; norms and gates moved off their init."""
    import torch
    import transformers

    vision_class, config_class, text_architecture = RELEASED[architecture]
    text_class, fields = ARCHITECTURES[text_architecture]
    text = getattr(transformers, text_class)(**fields)
    vision = getattr(transformers, vision_class)(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=fields["hidden_size"]
    )
    config = getattr(transformers, config_class)(text_config=text.to_dict(), vision_config=vision.to_dict())
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    _redraw(model)
    os.makedirs(path, exist_ok=True)
    save_tokenizer(path, vocab_size=fields["vocab_size"])
    model.save_pretrained(path, safe_serialization=True)
    return path


def _redraw(model) -> None:
    """Weights re-drawn larger than HF's init so greedy text varies; norms and per-head scalars
    moved off their init so a wrong mapping shows."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decays between exp(-0.5) and exp(-4) a token at a = 0
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0))
            elif p.dim() >= 2:
                p.normal_(0.0, 0.3)
            else:
                p.add_(torch.randn_like(p) * 0.2)
