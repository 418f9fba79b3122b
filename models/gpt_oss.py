# SPDX-License-Identifier: Apache-2.0
"""GPT-OSS: pre-norm blocks whose attention (biases on q/k/v/o, YaRN RoPE) has attention sinks
(a learned logit per query head in the softmax denominator) and alternates sliding-window and
full layers (`layer_types`), and whose MLP is a top-k routed mixture of experts: a router with a
bias, softmax over the chosen k logits, and experts with biases and a clamped SwiGLU,
`(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`.

Checkpoints hold the experts stacked as transformers does: `gate_up_proj [E, D, 2F]` with gate
and up columns interleaved (`g0 u0 g1 u1 ..`), `down_proj [E, F, D]` (inputs first), and
their biases. They are kept in that layout: split over a mesh on the last axis, each device
holds whole gate/up pairs. The released checkpoints' mxfp4 experts (`quantization_config`
`quant_method: mxfp4`: `*_blocks` and `*_scales` in the `[out, in]` order, `models.mxfp4`) are
kept in mxfp4 and dequantized tile by tile inside the routed matmul; over a mesh each device
holds whole 32-value blocks of its share (gate/up split on their outputs, down on its inputs),
F padded with zeros to whole blocks a device where it does not split so (`pad_for_mesh`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import expert_load
from models.config import ModelConfig
from models.layers import ATTENTION_LINEARS, CausalLM, DecoderLayer, PagedAttention, decoder_hf_param_map
from models.linear import Linear
from models.metadata import AttentionMetadata
from models.moe import (
    experts_by_index,
    experts_routed,
    experts_routed_on_mesh,
    route,
)
from models.mxfp4 import BLOCK, Mxfp4Stack, blocks_on_mesh, is_mxfp4, zero_padded

_LAYER = "model.layers.{i}"
_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_MXFP4_EXPERTS = tuple(f"{p}_{part}" for p in ("gate_up_proj", "down_proj") for part in ("blocks", "scales"))
# HF checkpoint name -> our parameter path ("{i}" is the layer index).
HF_PARAM_MAP = {
    **decoder_hf_param_map(linears=ATTENTION_LINEARS, norms=("input_layernorm", "post_attention_layernorm")),
    f"{_LAYER}.self_attn.sinks": f"{_LAYER}.self_attn.sinks",
    f"{_LAYER}.mlp.router.weight": f"{_LAYER}.mlp.router.kernel",
    f"{_LAYER}.mlp.router.bias": f"{_LAYER}.mlp.router.bias",
    **{f"{_LAYER}.mlp.experts.{name}": f"{_LAYER}.mlp.experts.{name}" for name in _EXPERTS + _MXFP4_EXPERTS},
}


@dataclasses.dataclass(frozen=True, slots=True)
class GptOssConfig(ModelConfig):
    """`ModelConfig` with the experts' clamped SwiGLU: `swiglu_alpha` (sigmoid gain) and
    `swiglu_limit` (clamp); `mxfp4`: the experts are mxfp4 blocks and scales (`models.mxfp4`)."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4: bool = False

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> GptOssConfig:
        # `ModelConfig.from_hf_dict` builds `cls` with its own fields (a slots dataclass's
        # classmethod cannot use zero-argument super()).
        base = ModelConfig.from_hf_dict.__func__(cls, hf)
        config = dataclasses.replace(
            base,
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
            mxfp4=is_mxfp4(hf),
        )
        inputs = {"hidden_size": config.hidden_size, "intermediate_size": config.moe_intermediate_size}
        uneven = {name: size for name, size in inputs.items() if size % BLOCK}
        if config.mxfp4 and uneven:
            raise ValueError(
                f"GPT-OSS mxfp4 checkpoint: {uneven} do not divide into the format's {BLOCK}-value "
                "blocks; the checkpoint is malformed"
            )
        return config


def clamped_swiglu(gate_up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """`[.., 2F]` interleaved gate/up products -> `[.., F]`: GPT-OSS's clamped SwiGLU."""
    gate = jnp.minimum(gate_up[..., ::2], limit)
    up = jnp.clip(gate_up[..., 1::2], -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)


class GptOssExperts(nnx.Module):
    """The E experts in the checkpoint's layout: `gate_up_proj [E, D, 2F]` (gate and up columns
    interleaved) with its bias `[E, 2F]`, `down_proj [E, F, D]` with its bias `[E, D]`. `mxfp4`:
    the kernels as the checkpoint's `gate_up_proj_blocks [E, 2F, D / 32, 16]` and
    `gate_up_proj_scales [E, 2F, D / 32]`, `down_proj_blocks [E, D, F / 32, 16]` and
    `down_proj_scales [E, D, F / 32]` (uint8, `models.mxfp4`) instead."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: jnp.dtype,
        mxfp4: bool = False,
    ):
        e, d, f = num_experts, hidden_size, intermediate_size
        if mxfp4:  # host zeros until loaded
            self.gate_up_proj_blocks = nnx.Param(np.zeros((e, 2 * f, d // BLOCK, BLOCK // 2), np.uint8))
            self.gate_up_proj_scales = nnx.Param(np.zeros((e, 2 * f, d // BLOCK), np.uint8))
            self.down_proj_blocks = nnx.Param(np.zeros((e, d, f // BLOCK, BLOCK // 2), np.uint8))
            self.down_proj_scales = nnx.Param(np.zeros((e, d, f // BLOCK), np.uint8))
        else:
            self.gate_up_proj = nnx.Param(np.zeros((e, d, 2 * f), dtype))
            self.down_proj = nnx.Param(np.zeros((e, f, d), dtype))
        self.gate_up_proj_bias = nnx.Param(np.zeros((e, 2 * f), dtype))
        self.down_proj_bias = nnx.Param(np.zeros((e, d), dtype))
        self.mxfp4 = mxfp4

    def pad_for_mesh(self, tp_size: int) -> None:
        """mxfp4 experts: F padded with zero gate/up pairs and zero down inputs up to whole
        32-value blocks on each of `tp_size` devices (gpt-oss's 2880 = 90 blocks on 8: 96).
        A zero pair's clamped SwiGLU is 0, so the output is unchanged (`loader.prepare_for_serving`)."""
        if not self.mxfp4:
            return
        f = self.down_proj_blocks.get_value().shape[2] * BLOCK
        padded = blocks_on_mesh(f, tp_size)
        if padded == f:
            return
        for name, axis, size in (
            ("gate_up_proj_blocks", 1, 2 * padded),
            ("gate_up_proj_scales", 1, 2 * padded),
            ("gate_up_proj_bias", 1, 2 * padded),
            ("down_proj_blocks", 2, padded // BLOCK),
            ("down_proj_scales", 2, padded // BLOCK),
        ):
            value = getattr(self, name).get_value()
            shape = (*value.shape[:axis], size, *value.shape[axis + 1 :])
            setattr(self, name, nnx.Param(zero_padded(value, shape)))

    def kernels(self) -> tuple[jax.Array | Mxfp4Stack, jax.Array | Mxfp4Stack]:
        """gate_up `[E, D, 2F]` and down `[E, F, D]` as arrays, or as `Mxfp4Stack`s of those shapes."""
        if self.mxfp4:
            return (
                Mxfp4Stack(self.gate_up_proj_blocks[...], self.gate_up_proj_scales[...]),
                Mxfp4Stack(self.down_proj_blocks[...], self.down_proj_scales[...]),
            )
        return self.gate_up_proj[...], self.down_proj[...]


class GptOssMoE(nnx.Module):
    """Router `[D, E]` with a bias, top-k experts weighted by a softmax over their k logits."""

    # Experts split by index over the step's mesh (`moe.use_expert_parallel`), else inside each expert.
    expert_parallel: bool = False

    def __init__(self, config: GptOssConfig, *, dtype: jnp.dtype):
        d, e = config.hidden_size, config.num_experts
        self.router = Linear(d, e, bias=True, dtype=dtype)
        self.experts = GptOssExperts(e, d, config.moe_intermediate_size, dtype=dtype, mxfp4=config.mxfp4)
        self.top_k = config.num_experts_per_tok
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

    def __call__(self, x: jax.Array, md: AttentionMetadata | None = None) -> jax.Array:
        """`md`: the step's metadata; its mesh splits the experts by index under expert
        parallelism, else each expert's F (whole gate/up pairs a device; whole 32-value blocks of
        down's inputs for mxfp4 experts) when the TP size divides it, else XLA places the work."""
        # Softmax over the top k logits is the full softmax's top k renormalized.
        weights, experts = route(self.router(x), self.top_k, renormalize=True)  # [T, k]
        ex = self.experts
        (gate_up, down), gate_up_bias = ex.kernels(), ex.gate_up_proj_bias[...]
        expert_load.record(self, experts, gate_up_bias.shape[0], md)
        act = functools.partial(clamped_swiglu, alpha=self.alpha, limit=self.limit)
        if md is not None and (md.mesh is not None or md.replicas > 1) and self.expert_parallel:
            by_index = dict(gate_bias=gate_up_bias, down_bias=ex.down_proj_bias[...])
            return experts_by_index(
                x, (gate_up, None, down), weights, experts, act, mesh=md.mesh, over_replicas=md.replicas > 1,
                **by_index,
            )  # fmt: skip
        split = down.shape[1] // (BLOCK if ex.mxfp4 else 1)  # the units a device holds whole
        if md is not None and md.mesh is not None and split % md.tp_size == 0:
            y = experts_routed_on_mesh(
                md.mesh, x, (gate_up, None, down), weights, experts, act, gate_bias=gate_up_bias
            )
        else:
            y = experts_routed(x, gate_up, None, down, weights, experts, act, gate_bias=gate_up_bias)
        # The down bias once per chosen expert, after any sum over devices.
        bias = jnp.einsum("tk,tkd->td", weights, ex.down_proj_bias[...][experts].astype(jnp.float32))
        return (y.astype(jnp.float32) + bias).astype(x.dtype)  # [T, D]


class GptOssForCausalLM(CausalLM):
    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: GptOssConfig, *, dtype: jnp.dtype):
        layers = [
            DecoderLayer(
                config,
                PagedAttention(
                    config, dtype=dtype, sliding_window=config.layer_sliding_windows[i], sinks=True
                ),
                GptOssMoE(config, dtype=dtype),
                dtype=dtype,
            )
            for i in range(config.num_layers)
        ]
        super().__init__(config, layers, dtype=dtype)
