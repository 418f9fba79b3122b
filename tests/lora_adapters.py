# SPDX-License-Identifier: Apache-2.0
"""Random PEFT LoRA adapters written by hand (adapter_config.json + adapter_model.safetensors,
as PEFT saves them), and the transformers reference with an adapter merged into its weights."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import numpy as np

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def module_path(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if target in ATTENTION else 'mlp'}.{target}"


def write_adapter(
    path: str,
    hf_model,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str],
    seed: int,
    base_model: str = "",
    rslora: bool = False,
    std: float = 0.3,
    drop: str | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Writes a random adapter of `rank` on `targets` of every layer of `hf_model`'s shapes;
    returns `{module path: (A [r, in], B [out, r])}` as written. `drop` leaves one tensor out,
    `extra` adds tensors (both to make broken adapters)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors, weights = {}, {}
    for layer in range(hf_model.config.num_hidden_layers):
        for target in targets:
            module = module_path(layer, target)
            out_features, in_features = hf_model.get_submodule(module).weight.shape
            a = rng.normal(0.0, std, (rank, in_features)).astype(np.float32)
            b = rng.normal(0.0, std, (out_features, rank)).astype(np.float32)
            tensors[f"base_model.model.{module}.lora_A.weight"] = a
            tensors[f"base_model.model.{module}.lora_B.weight"] = b
            weights[module] = (a, b)
    if drop is not None:
        del tensors[drop]
    tensors.update(extra or {})
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return weights


def scaling(rank: int, alpha: float, rslora: bool = False) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def merged(hf_model, weights: dict[str, tuple[np.ndarray, np.ndarray]], scale: float):
    """A copy of `hf_model` with `W + scale * B @ A` in every adapted projection."""
    import copy

    import torch

    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for module, (a, b) in weights.items():
            weight = model.get_submodule(module).weight
            delta = scale * (b.astype(np.float64) @ a.astype(np.float64))
            weight.copy_(torch.from_numpy((weight.numpy().astype(np.float64) + delta).astype(np.float32)))
    return model.eval()
