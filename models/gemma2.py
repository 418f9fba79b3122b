# SPDX-License-Identifier: Apache-2.0
"""Gemma 2 (text): embeddings scaled by `sqrt(D)`, `(1 + w)` RMSNorms before and after attention and
the MLP, GeGLU (gelu-tanh) MLP, softmax scale `query_pre_attn_scalar ** -0.5`, tanh soft-capping of
attention scores and of the final logits, and sliding-window layers alternating with global ones
(`layer_types`; by default layers 0, 2, 4, ... slide)."""

from __future__ import annotations

import jax.numpy as jnp

from models.config import ModelConfig
from models.layers import (
    ATTENTION_LINEARS,
    MLP_LINEARS,
    CausalLM,
    GatedMLP,
    PagedAttention,
    SandwichDecoderLayer,
    decoder_hf_param_map,
)

NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
# HF checkpoint name -> our parameter path ("{i}" is the layer index).
HF_PARAM_MAP = decoder_hf_param_map(linears=(*ATTENTION_LINEARS, *MLP_LINEARS), norms=NORMS)


def query_scale(config: ModelConfig) -> float | None:
    """Gemma's softmax scale, `query_pre_attn_scalar ** -0.5` (None: the default `H ** -0.5`)."""
    scalar = config.query_pre_attn_scalar
    return None if scalar is None else float(scalar) ** -0.5


class Gemma2ForCausalLM(CausalLM):
    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype):
        layers = [
            SandwichDecoderLayer(
                config,
                PagedAttention(
                    config,
                    dtype=dtype,
                    sm_scale=query_scale(config),
                    soft_cap=config.attn_logit_softcap,
                    sliding_window=config.layer_sliding_windows[i],
                ),
                GatedMLP.from_config(config, dtype=dtype),
                dtype=dtype,
            )
            for i in range(config.num_layers)
        ]
        super().__init__(
            config, layers, dtype=dtype, embed_scale=config.hidden_size**0.5, norm_unit_offset=True,
            final_soft_cap=config.final_logit_softcap,
        )  # fmt: skip
