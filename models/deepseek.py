# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V2 and V3 (also R1, Kimi K2, Moonlight): the pre-norm decoder block with multi-head
latent attention (`latent_attention.py`) and DeepSeek MoE (`deepseek_moe.py`): dense MLPs in the
first `first_k_dense_replace` layers, then routed experts beside shared ones every
`moe_layer_freq`-th layer. The multi-token-prediction layer some checkpoints carry after the
last layer (`num_nextn_predict_layers`) is not part of the target: its tensors are skipped on
load, and read only as the draft head of speculative method 'mtp' (`models.mtp`)."""

from __future__ import annotations

import re

import jax.numpy as jnp

from models.deepseek_config import DeepseekConfig
from models.deepseek_moe import ROUTED_HF_PARAM_MAP, SHARED_EXPERT_LINEARS, deepseek_mlp
from models.latent_attention import LatentAttention
from models.layers import MLP_LINEARS, CausalLM, DecoderLayer, decoder_hf_param_map

_LAYER = "model.layers.{i}"
_ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
# HF checkpoint name -> our parameter path ("{i}" layer, "{e}" expert: fills slot e of a stacked kernel).
HF_PARAM_MAP = {
    **decoder_hf_param_map(
        linears=(*(f"self_attn.{name}" for name in _ATTENTION), *MLP_LINEARS, *SHARED_EXPERT_LINEARS),
        norms=(
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_a_layernorm",
            "self_attn.kv_a_layernorm",
        ),
    ),
    f"{_LAYER}.self_attn.kv_b_proj.weight": f"{_LAYER}.self_attn.kv_b_proj.kernel",
    **ROUTED_HF_PARAM_MAP,
}
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def after_last_layer(name: str, num_layers: int) -> bool:
    """Whether checkpoint tensor `name` belongs to a layer numbered after the last decoder layer:
    the multi-token-prediction layers DeepSeek-V3 and GLM-4.5 checkpoints carry."""
    match = _LAYER_INDEX.match(name)
    return match is not None and int(match.group(1)) >= num_layers


def deepseek_decoder_layer(config: DeepseekConfig, i: int, *, dtype: jnp.dtype) -> DecoderLayer:
    """Layer `i`: latent attention, then the dense MLP or DeepSeek MoE as `i` says (also the
    multi-token-prediction layer's block, numbered after the last layer)."""
    return DecoderLayer(
        config, LatentAttention(config, dtype=dtype), deepseek_mlp(config, i, dtype=dtype), dtype=dtype
    )


class DeepseekV2ForCausalLM(CausalLM):
    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: DeepseekConfig, *, dtype: jnp.dtype):
        layers = [deepseek_decoder_layer(config, i, dtype=dtype) for i in range(config.num_layers)]
        super().__init__(config, layers, dtype=dtype)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is deliberately not loaded: the multi-token-prediction
        layers, numbered after the last decoder layer."""
        return after_last_layer(name, self.config.num_layers)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """The same model: V3's sigmoid routing, correction bias and low-rank queries are its config's."""
