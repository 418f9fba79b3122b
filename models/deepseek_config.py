# SPDX-License-Identifier: Apache-2.0
"""The DeepSeek-V2/V3 configuration: multi-head latent attention fields on top of DeepSeek MoE's
(`deepseek_moe.DeepseekMoeConfig`); also Kimi K2 and Moonlight, which ship `DeepseekV3ForCausalLM`
configs."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.config import _rope_parameters, _rope_theta
from models.deepseek_moe import DeepseekMoeConfig, moe_fields_from_hf
from models.rope import YarnScaling


@dataclasses.dataclass(frozen=True, slots=True)
class DeepseekConfig(DeepseekMoeConfig):
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

    @property
    def latent_cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

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
        return dataclasses.replace(
            base,
            head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
            num_kv_heads=base.num_heads,
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,
            yarn=_yarn(hf),
            **moe_fields_from_hf(
                hf, topk_method="noaux_tc" if v3 else "greedy", scoring_func="sigmoid" if v3 else "softmax"
            ),
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
