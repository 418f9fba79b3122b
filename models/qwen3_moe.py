# SPDX-License-Identifier: Apache-2.0
"""Qwen3-MoE: the Qwen3 block (per-head q/k RMSNorm) with a top-k routed mixture of SwiGLU experts;
routing weights renormalized only with `norm_topk_prob`. Layers listed in `mlp_only_layers` (or
off the `decoder_sparse_step` grid) keep a dense MLP of `intermediate_size`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

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
from models.moe import SparseMoE

_LAYER = "model.layers.{i}"
# HF checkpoint name -> our parameter path ("{i}" layer, "{e}" expert: fills slot e of a stacked kernel).
HF_PARAM_MAP = {
    **decoder_hf_param_map(
        linears=(*ATTENTION_LINEARS, *MLP_LINEARS),
        norms=("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"),
    ),
    f"{_LAYER}.mlp.gate.weight": f"{_LAYER}.mlp.router.kernel",
    **{
        f"{_LAYER}.mlp.experts.{{e}}.{proj}.weight": f"{_LAYER}.mlp.experts.{proj}.kernel"
        for proj in ("gate_proj", "up_proj", "down_proj")
    },
}


def _mlp(config: ModelConfig, layer: int, dtype: jnp.dtype) -> nnx.Module:
    if config.is_moe_layer(layer):
        return SparseMoE.from_config(
            config, config.moe_intermediate_size, renormalize=config.norm_topk_prob, dtype=dtype
        )
    return GatedMLP.from_config(config, dtype=dtype)


class Qwen3MoeForCausalLM(CausalLM):
    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype):
        layers = [
            DecoderLayer(
                config,
                PagedAttention(
                    config, dtype=dtype, qk_norm=True, sliding_window=config.layer_sliding_windows[i]
                ),
                _mlp(config, i, dtype),
                dtype=dtype,
            )
            for i in range(config.num_layers)
        ]
        super().__init__(config, layers, dtype=dtype)
