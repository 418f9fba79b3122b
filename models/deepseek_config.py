# SPDX-License-Identifier: Apache-2.0
"""The DeepSeek-V2/V3 configuration: multi-head latent attention and DeepSeek MoE fields on top
of `ModelConfig` (also Kimi K2 and Moonlight, which ship `DeepseekV3ForCausalLM` configs)."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.config import ModelConfig, _rope_parameters, _rope_theta
from models.rope import YarnScaling

# Expert selection: V2's softmax top-k, whole or from the best groups (`group_limited_greedy`);
# V3's sigmoid scores with a correction bias and group top-k (`noaux_tc`).
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclasses.dataclass(frozen=True, slots=True)
class DeepseekConfig(ModelConfig):
    """`head_dim` is the query/key head width `qk_nope_head_dim + qk_rope_head_dim`; the KV
    cache holds `kv_lora_rank + qk_rope_head_dim` values a token a layer (`latent_cache_width`)."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # Rotate the rope dimensions as interleaved pairs (V2 always; V3's `rope_interleave`).
    rope_interleave: bool = True
    yarn: YarnScaling | None = None
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; supported: {TOPK_METHODS}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported: 'softmax' or 'sigmoid'")
        if self.num_experts and (self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group):
            raise ValueError(
                f"{self.num_experts} experts in n_group={self.n_group} groups with topk_group="
                f"{self.topk_group}: the groups must divide the experts and 1 <= topk_group <= n_group"
            )

    @property
    def latent_cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Routed experts from layer `first_k_dense_replace` on, every `moe_layer_freq`-th layer."""
        return (
            self.num_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0
        )

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> DeepseekConfig:
        theta = _rope_theta(hf)
        plain_rope = {
            **hf,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        }
        base = super(DeepseekConfig, cls).from_hf_dict(plain_rope)
        v3 = hf["architectures"][0] == "DeepseekV3ForCausalLM"
        n_group = hf.get("n_group") or 1
        return dataclasses.replace(
            base,
            head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
            num_kv_heads=base.num_heads,
            num_experts=hf.get("n_routed_experts") or 0,
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,
            yarn=_yarn(hf),
            n_shared_experts=hf.get("n_shared_experts") or 0,
            routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            topk_method=hf.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
            scoring_func=hf.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            n_group=n_group,
            topk_group=hf.get("topk_group") or n_group,
            first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
            moe_layer_freq=hf.get("moe_layer_freq") or 1,
        )


def _yarn(hf: dict[str, Any]) -> YarnScaling | None:
    params = _rope_parameters(hf)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(
            f"DeepSeek rope scaling type {kind!r} is not supported; supported: 'default', 'yarn'"
        )
    original = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    return YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        truncate=bool(params.get("truncate", True)),
    )
