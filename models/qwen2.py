# SPDX-License-Identifier: Apache-2.0
"""Qwen2 / Qwen2.5: the Llama block with biases on the q/k/v projections (none on o_proj), and
optional sliding-window attention on the top layers (`max_window_layers`)."""

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
    linears=(*ATTENTION_LINEARS, *MLP_LINEARS), norms=("input_layernorm", "post_attention_layernorm")
)


class Qwen2ForCausalLM(CausalLM):
    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype):
        layers = [
            DecoderLayer(
                config,
                PagedAttention(
                    config,
                    dtype=dtype,
                    qkv_bias=True,
                    out_bias=False,
                    sliding_window=config.layer_sliding_windows[i],
                ),
                GatedMLP.from_config(config, dtype=dtype),
                dtype=dtype,
            )
            for i in range(config.num_layers)
        ]
        super().__init__(config, layers, dtype=dtype)
