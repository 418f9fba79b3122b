# SPDX-License-Identifier: Apache-2.0
"""Qwen3 (dense): the Llama block with an RMSNorm over each q/k head before RoPE."""

from __future__ import annotations

import jax.numpy as jnp

from models.config import ModelConfig
from models.layers import (
    ATTENTION_LINEARS,
    MLP_LINEARS,
    CausalLM,
    DecoderLayer,
    GatedMLP,
    PagedAttention,
    decoder_hf_param_map,
)

# HF checkpoint name -> our parameter path ("{i}" is the layer index).
HF_PARAM_MAP = decoder_hf_param_map(
    linears=(*ATTENTION_LINEARS, *MLP_LINEARS),
    norms=("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"),
)


class Qwen3ForCausalLM(CausalLM):
    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype):
        layers = [
            DecoderLayer(
                config,
                PagedAttention(
                    config, dtype=dtype, qk_norm=True, sliding_window=config.layer_sliding_windows[i]
                ),
                GatedMLP.from_config(config, dtype=dtype),
                dtype=dtype,
            )
            for i in range(config.num_layers)
        ]
        super().__init__(config, layers, dtype=dtype)
