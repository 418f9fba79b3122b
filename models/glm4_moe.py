# SPDX-License-Identifier: Apache-2.0
"""GLM-4.5 and GLM-4.6 (`Glm4MoeForCausalLM`; GLM-4.5-Air too): pre-norm blocks of grouped-query
attention and DeepSeek-V3's MoE (`deepseek_moe.py`).

- Attention: biases on q, k and v (`attention_bias`; never on o), an RMSNorm of each q and k
  head before the rotation when `use_qk_norm`, and RoPE on the first `partial_rotary_factor` of
  each head's dimensions (half, by default), rotated as halves of those dimensions, the others
  passed unchanged (transformers' and vLLM's convention).
- MoE: dense MLPs in the first `first_k_dense_replace` layers, then sigmoid-scored routed
  experts chosen by group with `e_score_correction_bias` (`n_group`, `topk_group`), weights
  normalized (`norm_topk_prob`) and scaled (`routed_scaling_factor`), beside
  `n_shared_experts` shared ones.

The multi-token-prediction layer (`num_nextn_predict_layers`) stored after the last decoder
layer is not part of the target: its tensors are skipped on load, as vLLM's own loader skips
them, and read only as the draft head of speculative method 'mtp' (`models.mtp`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from models.config import ModelConfig
from models.deepseek import after_last_layer
from models.deepseek_moe import (
    ROUTED_HF_PARAM_MAP,
    SHARED_EXPERT_LINEARS,
    DeepseekMoeConfig,
    deepseek_mlp,
    moe_fields_from_hf,
)
from models.layers import (
    ATTENTION_LINEARS,
    MLP_LINEARS,
    CausalLM,
    DecoderLayer,
    PagedAttention,
    decoder_hf_param_map,
)

# HF checkpoint name -> our parameter path ("{i}" layer, "{e}" expert: fills slot e of a stacked kernel).
HF_PARAM_MAP = {
    **decoder_hf_param_map(
        linears=(*ATTENTION_LINEARS, *MLP_LINEARS, *SHARED_EXPERT_LINEARS),
        norms=("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"),
    ),
    **ROUTED_HF_PARAM_MAP,
}
# vLLM's default where a config names no factor (GLM-4.5's configs name 0.5).
_PARTIAL_ROTARY_FACTOR = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class Glm4MoeConfig(DeepseekMoeConfig):
    """DeepSeek MoE's configuration (always V3's sigmoid group routing, `noaux_tc`) with GLM's
    attention fields: the rotated share of each head and the per-head q/k norm."""

    partial_rotary_factor: float = _PARTIAL_ROTARY_FACTOR
    use_qk_norm: bool = False

    def __post_init__(self) -> None:
        DeepseekMoeConfig.__post_init__(self)
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim}: the "
                "rotated dimensions must be an even count, at most the head's"
            )

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each q and k head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> Glm4MoeConfig:
        # `ModelConfig.from_hf_dict` builds `cls` with its own fields (a slots dataclass's
        # classmethod cannot use zero-argument super()).
        base = ModelConfig.from_hf_dict.__func__(cls, hf)
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        factor = (
            hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or _PARTIAL_ROTARY_FACTOR
        )
        return dataclasses.replace(
            base,
            partial_rotary_factor=float(factor),
            use_qk_norm=bool(hf.get("use_qk_norm", False)),
            **moe_fields_from_hf(hf, topk_method="noaux_tc", scoring_func="sigmoid"),
        )


def glm4_moe_decoder_layer(config: Glm4MoeConfig, i: int, *, dtype: jnp.dtype) -> DecoderLayer:
    """Layer `i`: GLM's attention, then the dense MLP or DeepSeek MoE as `i` says (also the
    multi-token-prediction layer's block, numbered after the last layer)."""
    attention = PagedAttention(
        config, dtype=dtype, out_bias=False, qk_norm=config.use_qk_norm, rotary_dim=config.rotary_dim
    )
    return DecoderLayer(config, attention, deepseek_mlp(config, i, dtype=dtype), dtype=dtype)


class Glm4MoeForCausalLM(CausalLM):
    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: Glm4MoeConfig, *, dtype: jnp.dtype):
        layers = [glm4_moe_decoder_layer(config, i, dtype=dtype) for i in range(config.num_layers)]
        super().__init__(config, layers, dtype=dtype)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is deliberately not loaded: the multi-token-prediction
        layers, numbered after the last decoder layer."""
        return after_last_layer(name, self.config.num_layers)
