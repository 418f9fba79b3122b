# SPDX-License-Identifier: Apache-2.0
"""Model configuration parsed from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture hyper-parameters, frozen once parsed."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds the config from a parsed HF `config.json` dict."""
        architectures = hf.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry; cannot choose a model class")
        num_heads = hf["num_attention_heads"]
        return cls(
            architecture=architectures[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
        )

    @classmethod
    def from_pretrained(cls, path: str) -> ModelConfig:
        """Reads `config.json` from a model directory."""
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf_dict(json.load(f))


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _rope_theta(hf: dict[str, Any]) -> float:
    return float(hf.get("rope_theta") or _rope_parameters(hf).get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling | None:
    params = _rope_parameters(hf)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope scaling type {kind!r} is not supported; supported: 'default', 'llama3'")
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
