# SPDX-License-Identifier: Apache-2.0
"""Model configuration parsed from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from models.architectures import config_class


@dataclasses.dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling: `linear` (every frequency divided by `factor`), `llama3`
    (frequency-dependent: `low_freq_factor`, `high_freq_factor`) or `yarn` (frequencies blended
    between interpolated and original over the dimensions between `beta_fast` and `beta_slow`
    rotations, `truncate` rounding that range to whole dimensions; cosines and sines scaled by
    `attention_factor`). `original_max_position_embeddings` serves `llama3` and `yarn`."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture hyper-parameters, frozen once parsed.

    `layer_sliding_windows[i]` is layer i's attention window (None: full attention); it is filled
    with `(None,) * num_layers` when not given.
    """

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
    hidden_act: str = "silu"
    layer_sliding_windows: tuple[int | None, ...] = ()
    # RoPE base of the sliding-window layers when it differs from `rope_theta` (Gemma 3).
    rope_local_theta: float | None = None
    # Gemma 2/3: softmax scale `query_pre_attn_scalar ** -0.5` and tanh soft-capping.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE); 0 experts means a dense MLP in every layer.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # A `*ForSequenceClassification` checkpoint's labels (its score head's rows); 0 for a causal LM.
    num_labels: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.layer_sliding_windows:
            object.__setattr__(self, "layer_sliding_windows", (None,) * self.num_layers)
        if len(self.layer_sliding_windows) != self.num_layers:
            raise ValueError(
                f"{len(self.layer_sliding_windows)} per-layer sliding windows for {self.num_layers} layers"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..{self.num_experts}"
            )

    @property
    def sliding_window(self) -> int | None:
        """The window every layer shares (e.g. Mistral); None when no layer slides or when sliding
        and full-attention layers alternate (Gemma 2/3: see `layer_sliding_windows`)."""
        windows = set(self.layer_sliding_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def layer_attention_chunks(self) -> tuple[int | None, ...]:
        """Layer i's attention chunk size (chunked local attention: a query sees only the keys of
        its own chunk of positions, Llama 4); None for a layer that attends to every earlier key."""
        return (None,) * self.num_layers

    @property
    def latent_cache_width(self) -> int:
        """Values a token takes in a layer's latent KV cache (multi-head latent attention: one
        shared row, `pallas_kernels.mla`); 0 for a model whose cache holds per-head K and V."""
        return 0

    @property
    def state_layers(self) -> tuple[int, ...]:
        """Layers that keep a fixed-size state per request instead of KV pages (linear attention,
        `models.gated_deltanet`); none for a model whose every layer attends over a KV cache."""
        return ()

    def kv_source(self, layer: int) -> int:
        """The layer whose KV cache `layer` reads: itself, unless the model shares caches
        across layers (Gemma 4's KV-shared layers, which have no cache of their own)."""
        return layer

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer` uses routed experts rather than a dense MLP."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds the config from a parsed HF `config.json` dict; on `ModelConfig` itself, with
        the config class registered for its architecture (`models.architectures`), which may read
        more fields of it."""
        architectures = hf.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry; cannot choose a model class")
        if cls is ModelConfig:
            registered = config_class(architectures[0])
            if registered is not ModelConfig:
                return registered.from_hf_dict(hf)
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        classifier = architectures[0].endswith("ForSequenceClassification")
        return cls(
            architecture=architectures[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            # A classifier's score head is its own weight, never the embedding's.
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)) and not classifier,
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
            layer_sliding_windows=_layer_sliding_windows(hf, num_layers),
            rope_local_theta=_rope_local_theta(hf),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            attn_logit_softcap=hf.get("attn_logit_softcapping"),
            final_logit_softcap=hf.get("final_logit_softcapping"),
            num_experts=hf.get("num_local_experts") or hf.get("num_experts") or 0,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            moe_intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            num_labels=_num_labels(hf) if classifier else 0,
        )

    @classmethod
    def from_pretrained(cls, path: str) -> ModelConfig:
        """Reads `config.json` from a model directory."""
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf_dict(json.load(f))


def _num_labels(hf: dict[str, Any]) -> int:
    """A classifier's label count, as transformers reads it (`id2label` first, then `num_labels`)."""
    if hf.get("id2label"):
        return len(hf["id2label"])
    return int(hf.get("num_labels") or 2)


def _layer_sliding_windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if window is None or not hf.get("use_sliding_window", True):
        return (None,) * num_layers
    layer_types = hf.get("layer_types") or _default_layer_types(hf, num_layers)
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _default_layer_types(hf: dict[str, Any], num_layers: int) -> list[str]:
    """HF's per-architecture layer pattern, for a `config.json` written before `layer_types` existed."""
    model_type = hf.get("model_type")
    if model_type == "gemma2":
        sliding = [i % 2 == 0 for i in range(num_layers)]
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = hf.get("sliding_window_pattern") or 6
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif "max_window_layers" in hf:  # Qwen2/Qwen3: the top layers slide
        sliding = [i >= hf["max_window_layers"] for i in range(num_layers)]
    else:  # Mistral, Mixtral: every layer
        sliding = [True] * num_layers
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of the full-attention layers (Gemma 3 keys them by layer type)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return params.get("full_attention", params) or {}


def _rope_theta(hf: dict[str, Any]) -> float:
    return float(hf.get("rope_theta") or _rope_parameters(hf).get("rope_theta") or 10000.0)


def _rope_local_theta(hf: dict[str, Any]) -> float | None:
    params = hf.get("rope_parameters") or {}
    local = hf.get("rope_local_base_freq") or (params.get("sliding_attention") or {}).get("rope_theta")
    return None if local is None else float(local)


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling | None:
    params = _rope_parameters(hf)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(factor=float(params["factor"]), rope_type="linear")
    if kind == "yarn":
        return _yarn_scaling(hf, params)
    if kind != "llama3":
        raise ValueError(
            f"rope scaling type {kind!r} is not supported; supported: 'default', 'linear', 'llama3', 'yarn'"
        )
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _yarn_scaling(hf: dict[str, Any], params: dict[str, Any]) -> RopeScaling:
    """YaRN's parameters as transformers reads them (`_compute_yarn_parameters`): the factor
    defaults to the context extension, the attention factor to `0.1 ln(factor) + 1` (or the
    ratio of two such terms with `mscale` and `mscale_all_dim`)."""
    original = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or hf.get("max_position_embeddings", original) / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        rope_type="yarn",
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention),
    )
