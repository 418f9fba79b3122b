# SPDX-License-Identifier: Apache-2.0
"""Mixtral: the Mistral block with a top-k routed mixture of SwiGLU experts in place of the MLP
(routing weights always renormalized over the chosen k)."""

from __future__ import annotations

import jax.numpy as jnp

from models.config import ModelConfig
from models.layers import ATTENTION_LINEARS, CausalLM, DecoderLayer, PagedAttention, decoder_hf_param_map
from models.moe import SparseMoE

_LAYER = "model.layers.{i}"
# HF checkpoint name -> our parameter path ("{i}" layer, "{e}" expert: fills slot e of a stacked kernel).
HF_PARAM_MAP = {
    **decoder_hf_param_map(linears=ATTENTION_LINEARS, norms=("input_layernorm", "post_attention_layernorm")),
    f"{_LAYER}.block_sparse_moe.gate.weight": f"{_LAYER}.mlp.router.kernel",
    f"{_LAYER}.block_sparse_moe.experts.{{e}}.w1.weight": f"{_LAYER}.mlp.experts.gate_proj.kernel",
    f"{_LAYER}.block_sparse_moe.experts.{{e}}.w2.weight": f"{_LAYER}.mlp.experts.down_proj.kernel",
    f"{_LAYER}.block_sparse_moe.experts.{{e}}.w3.weight": f"{_LAYER}.mlp.experts.up_proj.kernel",
}


class MixtralForCausalLM(CausalLM):
    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype):
        layers = [
            DecoderLayer(
                config,
                PagedAttention(config, dtype=dtype, sliding_window=config.layer_sliding_windows[i]),
                SparseMoE.from_config(config, config.intermediate_size, renormalize=True, dtype=dtype),
                dtype=dtype,
            )
            for i in range(config.num_layers)
        ]
        super().__init__(config, layers, dtype=dtype)
