# SPDX-License-Identifier: Apache-2.0
"""Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5's text models (`Qwen3_5ForCausalLM`, dense;
`Qwen3_5MoeForCausalLM`): hybrids of Gated DeltaNet layers (linear attention with a per-request
state, `models.gated_deltanet`) and gated full-attention layers, as `layer_types` names them
(three of every four linear by default: `full_attention_interval`). Qwen3.5's Gated DeltaNet has
four input projections where Qwen3-Next's has two; its RoPE is multimodal (`mrope_section`),
which for text (one position for every section) is plain RoPE; its MoE routes in every layer and
always renormalizes the top-k weights.

- Gated attention: q_proj gives each head's query and an output gate side by side (`[q_h,
  gate_h]`); the heads' output is multiplied by `sigmoid(gate)` before o_proj. RMSNorm `(1 + w)`
  of each q and k head, RoPE on the first `partial_rotary_factor` of each head's dimensions.
- Every RMSNorm of the trunk is `(1 + w)` (zero-centred weights).
- MoE: softmax top-k routed experts (`norm_topk_prob`) plus a shared expert whose output is
  scaled by `sigmoid(shared_expert_gate(x))`; `mlp_only_layers` (or off the
  `decoder_sparse_step` grid) keep a dense MLP.

The released Qwen3.5 checkpoints (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`) serve their text model: `text_config` read, the vision
tower (`model.visual.*`) not. The multi-token-prediction weights (`mtp.*`) are skipped on load
unless speculation asks for them (`models.qwen3_next_mtp`). A linear-attention
layer's cache is its pair of state pools (`GatedDeltaNet.allocate_state`); a full-attention
layer's is a KV cache as usual.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.fused_outputs import FusedOutputs
from models.gated_deltanet import _QKV, GatedDeltaNet, SplitProjectionGatedDeltaNet, fused_qkv
from models.layers import (
    ATTENTION_LINEARS,
    MLP_LINEARS,
    CausalLM,
    GatedMLP,
    PagedAttention,
    RMSNorm,
    decoder_hf_param_map,
)
from models.linear import Linear
from models.metadata import AttentionMetadata
from models.moe import SparseMoE

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
_LAYER = "model.layers.{i}"
# Qwen3-Next's two input projections, Qwen3.5's four, and the output projection.
# (Qwen3.5's `in_proj_qkv` is read as three: `gated_deltanet.fused_qkv`.)
_GDN = ("in_proj_qkvz", "in_proj_ba", *_QKV, "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
HF_PARAM_MAP = {
    **decoder_hf_param_map(
        linears=(
            *ATTENTION_LINEARS,
            *MLP_LINEARS,
            *(f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
            "mlp.shared_expert_gate",
            *(f"linear_attn.{p}" for p in _GDN),
        ),
        norms=(
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "linear_attn.norm",
        ),
    ),
    f"{_LAYER}.linear_attn.conv1d.weight": f"{_LAYER}.linear_attn.conv1d.weight",
    f"{_LAYER}.linear_attn.A_log": f"{_LAYER}.linear_attn.A_log",
    f"{_LAYER}.linear_attn.dt_bias": f"{_LAYER}.linear_attn.dt_bias",
    f"{_LAYER}.mlp.gate.weight": f"{_LAYER}.mlp.router.kernel",
    **{
        f"{_LAYER}.mlp.experts.{{e}}.{proj}.weight": f"{_LAYER}.mlp.experts.{proj}.kernel"
        for proj in ("gate_proj", "up_proj", "down_proj")
    },
}


@dataclasses.dataclass(frozen=True, slots=True)
class Qwen3NextConfig(ModelConfig):
    """`ModelConfig` with Qwen3-Next's fields: each layer's kind, the linear-attention shapes,
    the shared expert and the rotated share of each attention head."""

    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    shared_expert_intermediate_size: int = 0
    partial_rotary_factor: float = 1.0
    # Qwen3.5's Gated DeltaNet: four input projections instead of two.
    split_linear_projections: bool = False

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)
        if not self.layer_types:
            object.__setattr__(self, "layer_types", _default_layer_types(self.num_layers))
        unknown = set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
        if len(self.layer_types) != self.num_layers or unknown:
            raise ValueError(
                f"layer_types must name {self.num_layers} layers, each {LINEAR_ATTENTION!r} or "
                f"{FULL_ATTENTION!r}; got {list(self.layer_types)}"
            )
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim}: the "
                "rotated dimensions must be an even count, at most the head's"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers: each keeps a conv and a recurrent state per request."""
        return tuple(i for i in range(self.num_layers) if self.is_linear_attention(i))

    @property
    def state_shapes(self) -> dict[str, int]:
        """A Gated DeltaNet layer's state facts (`pallas_kernels.allocate_state_pools`)."""
        keys, values = self.linear_num_key_heads * self.linear_key_head_dim, self.linear_num_value_heads
        return dict(
            conv_width=self.linear_conv_kernel_dim, conv_dim=2 * keys + values * self.linear_value_head_dim,
            num_heads=values, key_dim=self.linear_key_head_dim, value_dim=self.linear_value_head_dim,
        )  # fmt: skip

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> Qwen3NextConfig:
        # `ModelConfig.from_hf_dict` builds `cls` with its own fields (a slots dataclass's
        # classmethod cannot use zero-argument super()).
        if "text_config" in hf:  # Qwen3_5(Moe)ForConditionalGeneration: its text model's config
            hf = {**hf["text_config"], "architectures": hf.get("architectures")}
        moe_only = (hf.get("architectures") or [""])[0].startswith("Qwen3_5Moe")
        if moe_only:  # every layer routes, weights always normalized; no dense MLP size given
            hf = {**hf, "mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True}
            hf.setdefault("intermediate_size", hf["moe_intermediate_size"])
        base = ModelConfig.from_hf_dict.__func__(cls, hf)
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        factor = hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        return dataclasses.replace(
            base,
            layer_types=tuple(hf.get("layer_types") or _default_layer_types(base.num_layers, hf)),
            linear_num_key_heads=hf["linear_num_key_heads"],
            linear_num_value_heads=hf["linear_num_value_heads"],
            linear_key_head_dim=hf["linear_key_head_dim"],
            linear_value_head_dim=hf["linear_value_head_dim"],
            linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
            partial_rotary_factor=float(factor),
            split_linear_projections=base.architecture.startswith("Qwen3_5"),
        )


def _default_layer_types(num_layers: int, hf: dict[str, Any] | None = None) -> tuple[str, ...]:
    """transformers' default pattern: every `full_attention_interval`-th layer (4th) full."""
    interval = (hf or {}).get("full_attention_interval") or 4
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


class GatedAttention(PagedAttention):
    """`PagedAttention` whose q_proj also gives each head's output gate (module docstring).
    Fused (`fuse_projections`), its projection's blocks are `[q_i, gate_i, k_i, v_i]` per device
    (each device's q_proj columns hold its heads' queries and gates), so that on a mesh each
    device takes its own heads' queries, gates, keys and values from its own columns."""

    def __init__(self, config: Qwen3NextConfig, *, dtype: jnp.dtype):
        super().__init__(
            config, dtype=dtype, qk_norm=True, norm_unit_offset=True, rotary_dim=config.rotary_dim
        )
        n, h = config.num_heads, config.head_dim
        self.q_proj = Linear(config.hidden_size, 2 * n * h, bias=config.attention_bias, dtype=dtype)
        self.blocks = 1  # of the fused projection's columns: `fuse_projections`

    def _query_and_gate(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`(queries [T, N * H], gates [T, N * H], keys and values [T, 2 K * H])`, in blocks of
        whole heads, one a device (`self.blocks` of them, each device's `[k_i, v_i]` a block)."""
        t, n, h, blocks = x.shape[0], self.num_heads, self.head_dim, self.blocks
        if self.qkv_proj is None:
            both = self.q_proj(x).reshape(t, n, 2 * h)
            kv = jnp.concatenate([self.k_proj(x), self.v_proj(x)], axis=-1)
        else:  # a reshape keeps each device's own columns (`[q_i, gate_i, k_i, v_i]` blocks)
            fused = self.qkv_proj(x).reshape(t, blocks, -1)
            both = fused[..., : 2 * n * h // blocks].reshape(t, n, 2 * h)
            kv = fused[..., 2 * n * h // blocks :]
        return both[..., :h].reshape(t, n * h), both[..., h:].reshape(t, n * h), kv

    def _project_qkv(self, x: jax.Array) -> jax.Array:
        query, _, kv = self._query_and_gate(x)  # the same product as the gate's: XLA computes it once
        t, blocks = x.shape[0], self.blocks
        # `[q_i, k_i, v_i]` a device, as attention takes its heads
        qkv = jnp.concatenate([query.reshape(t, blocks, -1), kv.reshape(t, blocks, -1)], axis=-1)
        return qkv.reshape(t, -1)

    def gate_output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        _, gate, _ = self._query_and_gate(x)
        return o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)

    def fuse_projections(self, blocks: int = 1) -> None:
        """q (with the gates), k and v in one projection, in `blocks` blocks of whole heads."""
        super().fuse_projections(blocks)
        self.blocks = blocks


class SharedExpertMoE(SparseMoE):
    """`SparseMoE` plus a shared expert scaled by `sigmoid(shared_expert_gate(x))`."""

    def __init__(self, config: Qwen3NextConfig, *, dtype: jnp.dtype):
        super().__init__(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
            renormalize=config.norm_topk_prob, dtype=dtype, act=config.hidden_act,
        )  # fmt: skip
        size = config.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(
            config.hidden_size, size, bias=False, dtype=dtype, act=config.hidden_act
        )
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False, dtype=dtype)

    def __call__(
        self, x: jax.Array, md: AttentionMetadata | None = None, *, dense: bool = False
    ) -> jax.Array:
        routed = super().__call__(x, md, dense=dense)
        gate = jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32)).astype(x.dtype)
        return routed + gate * self.shared_expert(x, md)


class Qwen3NextDecoderLayer(nnx.Module):
    """Pre-norm block with `(1 + w)` norms around a linear- or full-attention token mixer."""

    def __init__(self, config: Qwen3NextConfig, layer: int, *, dtype: jnp.dtype):
        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, unit_offset=True)

        self.input_layernorm = norm()
        self.linear = config.is_linear_attention(layer)
        if self.linear:
            linear = SplitProjectionGatedDeltaNet if config.split_linear_projections else GatedDeltaNet
            self.linear_attn = linear(
                config.hidden_size, num_key_heads=config.linear_num_key_heads,
                num_value_heads=config.linear_num_value_heads, key_dim=config.linear_key_head_dim,
                value_dim=config.linear_value_head_dim, conv_width=config.linear_conv_kernel_dim,
                eps=config.rms_norm_eps, dtype=dtype,
            )  # fmt: skip
        else:
            self.self_attn = GatedAttention(config, dtype=dtype)
        self.post_attention_layernorm = norm()
        if config.is_moe_layer(layer):
            self.mlp = SharedExpertMoE(config, dtype=dtype)
        else:
            self.mlp = GatedMLP.from_config(config, dtype=dtype)

    def __call__(
        self, x: jax.Array, positions: jax.Array, cache: Any, md: AttentionMetadata
    ) -> tuple[jax.Array, Any]:
        mixer = self.linear_attn if self.linear else self.self_attn
        mixed, cache = mixer(self.input_layernorm(x), positions, cache, md)
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x), md), cache


# A Qwen3_5(Moe)ForConditionalGeneration checkpoint: the text model's prefix, and the tower not read.
_MULTIMODAL_TEXT = "model.language_model."
_NOT_TEXT = ("model.visual.",)


class Qwen3NextForCausalLM(CausalLM):
    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: Qwen3NextConfig, *, dtype: jnp.dtype):
        layers = [Qwen3NextDecoderLayer(config, i, dtype=dtype) for i in range(config.num_layers)]
        super().__init__(config, layers, dtype=dtype, norm_unit_offset=True)

    def checkpoint_name(self, name: str) -> str | None:
        """The name `hf_param_map` reads a checkpoint tensor under: a multimodal checkpoint's
        `model.language_model.` read as `model.`, None for its vision tower
        (`models.loader.model_name_rule`)."""
        if name.startswith(_NOT_TEXT):
            return None
        return "model." + name.removeprefix(_MULTIMODAL_TEXT) if name.startswith(_MULTIMODAL_TEXT) else name

    @property
    def fused_outputs(self) -> tuple[FusedOutputs, ...]:
        """Qwen3.5's `in_proj_qkv`, read as its q, k and v projections in every checkpoint
        format's layout (`gated_deltanet.fused_qkv`; `models.loader.model_tensors` cuts it)."""
        c = self.config
        if not c.split_linear_projections:
            return ()
        keys = c.linear_num_key_heads * c.linear_key_head_dim
        return (fused_qkv(keys, c.linear_num_value_heads * c.linear_value_head_dim),)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """The multi-token-prediction weights (`mtp.*`) are not loaded."""
        return name.startswith("mtp.")
