# SPDX-License-Identifier: Apache-2.0
"""Gemma 3 (text-only `Gemma3ForCausalLM`): the Gemma 2 block with `(1 + w)` RMSNorms over each q/k
head, local (sliding-window) layers with their own RoPE base (`rope_local_base_freq`) between
global layers (`layer_types`, or every `sliding_window_pattern`-th layer global), and no attention
soft-capping (HF ignores `attn_logit_softcapping` for Gemma 3); final logit soft-capping if set."""

from __future__ import annotations

import jax.numpy as jnp

from models.config import ModelConfig
from models.gemma2 import NORMS, query_scale
from models.layers import (
    ATTENTION_LINEARS,
    MLP_LINEARS,
    CausalLM,
    GatedMLP,
    PagedAttention,
    SandwichDecoderLayer,
    decoder_hf_param_map,
)
from models.rope import Rope

# HF checkpoint name -> our parameter path ("{i}" is the layer index).
HF_PARAM_MAP = decoder_hf_param_map(
    linears=(*ATTENTION_LINEARS, *MLP_LINEARS), norms=(*NORMS, "self_attn.q_norm", "self_attn.k_norm")
)


# HF's RoPE base for the local layers when config.json names none.
DEFAULT_LOCAL_THETA = 10_000.0


def layer_rope(config: ModelConfig, window: int | None) -> Rope:
    """Local layers: `rope_local_theta`, unscaled; global layers: `rope_theta` with its scaling."""
    if window is None:
        return Rope(config.rope_theta, config.rope_scaling)
    return Rope(config.rope_local_theta or DEFAULT_LOCAL_THETA)


class Gemma3ForCausalLM(CausalLM):
    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype):
        layers = [
            SandwichDecoderLayer(
                config,
                PagedAttention(
                    config,
                    dtype=dtype,
                    sm_scale=query_scale(config),
                    qk_norm=True,
                    norm_unit_offset=True,
                    sliding_window=window,
                    rope=layer_rope(config, window),
                ),
                GatedMLP.from_config(config, dtype=dtype),
                dtype=dtype,
            )
            for window in config.layer_sliding_windows
        ]
        super().__init__(
            config, layers, dtype=dtype, embed_scale=config.hidden_size**0.5, norm_unit_offset=True,
            final_soft_cap=config.final_logit_softcap,
        )  # fmt: skip
