# SPDX-License-Identifier: Apache-2.0
"""The Flax model: vllm-xla's shared Llama blocks, with scaled residual branches."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from models import AttentionMetadata, ModelConfig
from models.layers import CausalLM, DecoderLayer, GatedMLP, PagedAttention
from models.llama import HF_PARAM_MAP


@dataclasses.dataclass(frozen=True)
class ScaledResidualConfig(ModelConfig):
    """A Llama config with the multiplier of its residual branches."""

    residual_multiplier: float = 1.0

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ScaledResidualConfig:
        base = super().from_hf_dict(hf)
        return dataclasses.replace(base, residual_multiplier=float(hf.get("residual_multiplier", 1.0)))


class ScaledResidualDecoderLayer(DecoderLayer):
    """`x += m * attn(norm(x)); x += m * mlp(norm(x))`."""

    def __init__(
        self,
        config: ScaledResidualConfig,
        self_attn: PagedAttention,
        mlp: GatedMLP,
        *,
        dtype: jnp.dtype,
    ):
        super().__init__(config, self_attn, mlp, dtype=dtype)
        self.residual_multiplier = config.residual_multiplier

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        attn, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + self.residual_multiplier * attn
        return x + self.residual_multiplier * self.mlp(self.post_attention_layernorm(x)), kv_cache


class ScaledResidualLlamaForCausalLM(CausalLM):
    """Llama's parameters and checkpoint names; only the residual branches differ."""

    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: ScaledResidualConfig, *, dtype: jnp.dtype):
        layers = [
            ScaledResidualDecoderLayer(
                config,
                PagedAttention(config, dtype=dtype, sliding_window=config.layer_sliding_windows[i]),
                GatedMLP.from_config(config, dtype=dtype),
                dtype=dtype,
            )
            for i in range(config.num_layers)
        ]
        super().__init__(config, layers, dtype=dtype)
