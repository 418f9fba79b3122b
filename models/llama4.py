# SPDX-License-Identifier: Apache-2.0
"""Llama 4 (text): `Llama4ForCausalLM`, and the text model of `Llama4ForConditionalGeneration`.

Layers alternate two kinds of attention (`no_rope_layers[i]`: 1 for a RoPE layer): RoPE layers
rotate q and k in adjacent pairs (Meta's complex-number convention, not rotate-half), take an
L2 norm of each q and k head after the rotation (`use_qk_norm`, no weight) and attend within
chunks of `attention_chunk_size` positions; NoPE layers attend to every earlier key without a
rotation, their queries scaled by `log1p(floor((p + 1) / floor_scale)) * attn_scale + 1` at
position p (`attn_temperature_tuning`). The MLP is dense (`intermediate_size_mlp`) or, on the
layers `interleave_moe_layer_step` (or `moe_layers`) names, a mixture of experts: a shared
SwiGLU expert plus the top-k routed ones, whose sigmoid router scores multiply each expert's
input (not its output); both of `intermediate_size`.

Checkpoints hold the experts stacked, `gate_up_proj [E, D, 2F]` (gate columns, then up) and
`down_proj [E, F, D]`; they are read into per-expert gate, up and down kernels (split on F over
a mesh like every other MoE's). A multimodal checkpoint's text weights are under
`language_model.`; its vision tower and projector are not read (image inputs are refused at
start: `plugin_shim.feature_check`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from models.config import ModelConfig
from models.layers import (
    ATTENTION_LINEARS,
    CausalLM,
    DecoderLayer,
    GatedMLP,
    PagedAttention,
    decoder_hf_param_map,
)
from models.metadata import AttentionMetadata
from models.moe import SparseMoE
from models.rope import step_rope_table
from models.sharding import MODEL_AXIS
from pallas_kernels import kv_cache_partition_spec, ragged_paged_attention, write_kv
from pallas_kernels.rope import split_heads, table_rows

_LAYER = "model.layers.{i}"
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# HF checkpoint name -> our parameter path ("{i}" layer, "{e}" expert: `checkpoint_tensors`
# turns the stacked expert tensors into per-expert ones).
HF_PARAM_MAP = {
    **decoder_hf_param_map(linears=ATTENTION_LINEARS, norms=("input_layernorm", "post_attention_layernorm")),
    f"{_LAYER}.feed_forward.router.weight": f"{_LAYER}.mlp.router.kernel",
    **{f"{_LAYER}.feed_forward.{p}.weight": f"{_LAYER}.mlp.{p}.kernel" for p in _PROJECTIONS},
    **{
        f"{_LAYER}.feed_forward.shared_expert.{p}.weight": f"{_LAYER}.mlp.shared_expert.{p}.kernel"
        for p in _PROJECTIONS
    },
    **{
        f"{_LAYER}.feed_forward.experts.{{e}}.{p}.weight": f"{_LAYER}.mlp.experts.{p}.kernel"
        for p in _PROJECTIONS
    },
}
# A multimodal checkpoint's tensors outside its text model.
_NOT_TEXT = ("vision_model.", "multi_modal_projector.")


@dataclasses.dataclass(frozen=True, slots=True)
class Llama4Config(ModelConfig):
    """`ModelConfig` with Llama 4's attention: `rope_layers[i]` (RoPE and chunked attention, else
    NoPE and global), `attention_chunk_size`, `use_qk_norm`, and the NoPE layers' temperature
    tuning (`attn_temperature_tuning`, `floor_scale`, `attn_scale`). `intermediate_size` is the
    dense layers' MLP size, `moe_intermediate_size` the experts' and the shared expert's."""

    rope_layers: tuple[bool, ...] = ()
    attention_chunk_size: int | None = None
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)  # a slots dataclass cannot use zero-argument super()
        if not self.rope_layers:  # transformers' default: every fourth layer NoPE
            object.__setattr__(self, "rope_layers", tuple((i + 1) % 4 != 0 for i in range(self.num_layers)))
        if len(self.rope_layers) != self.num_layers:
            raise ValueError(f"{len(self.rope_layers)} per-layer RoPE flags for {self.num_layers} layers")

    @property
    def layer_attention_chunks(self) -> tuple[int | None, ...]:
        return tuple(self.attention_chunk_size if rope else None for rope in self.rope_layers)

    @property
    def n_shared_experts(self) -> int:
        """Shared experts beside the routed ones on each MoE layer (DeepSeek's field name: the
        planner counts their row-parallel sums)."""
        return 1 if self.num_experts else 0

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> Llama4Config:
        text = dict(hf.get("text_config") or hf)  # a multimodal config nests its text model's
        text["architectures"] = hf.get("architectures") or text.get("architectures")
        layers = text["num_hidden_layers"]
        moe_layers = text.get("moe_layers")
        if moe_layers is None:
            step = text.get("interleave_moe_layer_step") or 1
            moe_layers = range(step - 1, layers, step)
        interval = text.get("no_rope_layer_interval") or 4
        rope_layers = text.get("no_rope_layers") or [(i + 1) % interval != 0 for i in range(layers)]
        fields = {
            **text,
            "intermediate_size": text.get("intermediate_size_mlp") or text["intermediate_size"],
            "moe_intermediate_size": text["intermediate_size"],
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(layers) if i not in set(moe_layers)],
            "sliding_window": None,
        }
        base = ModelConfig.from_hf_dict.__func__(cls, fields)
        return dataclasses.replace(
            base,
            rope_layers=tuple(bool(r) for r in rope_layers),
            attention_chunk_size=text.get("attention_chunk_size"),
            use_qk_norm=bool(text.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(text.get("attn_temperature_tuning", True)),
            floor_scale=float(text.get("floor_scale", 8192)),
            attn_scale=float(text.get("attn_scale", 0.1)),
        )


def rotate_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates `x[T, heads, H]` by angles whose `cos`, `sin` are `[T, H/2]`, pair `(2j, 2j+1)` by
    angle j (Meta's complex-number RoPE), in float32; the result keeps `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    even, odd = x32[..., 0::2], x32[..., 1::2]  # [T, heads, H/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """Each head `x[..., H]` over its root mean square (float32, no weight)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def temperature_scales(positions: jax.Array, floor_scale: float, attn_scale: float) -> jax.Array:
    """`[T]` float32: the NoPE layers' query scale at each position."""
    steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_scale)
    return jnp.log1p(steps) * attn_scale + 1.0


class Llama4Attention(PagedAttention):
    """Grouped-query attention of a RoPE layer (pairwise rotation, L2 qk-norm, chunked) or a
    NoPE layer (no rotation, temperature-tuned queries, global), over the paged KV cache."""

    def __init__(self, config: Llama4Config, layer: int, *, dtype: jnp.dtype):
        super().__init__(config, dtype=dtype)
        rope = config.rope_layers[layer]
        self.use_rope = rope
        self.attention_chunk_size = config.layer_attention_chunks[layer]
        self.l2_eps = config.rms_norm_eps if rope and config.use_qk_norm else None
        self.temperature = (
            (config.floor_scale, config.attn_scale) if not rope and config.attn_temperature_tuning else None
        )

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        qkv = self._project_qkv(x)  # [T, (N + 2K) * H]
        inverse_frequencies = self.rope.inverse_frequencies(self.head_dim)
        table, rows = step_rope_table(positions, inverse_frequencies, self.rope_table)
        if md.mesh is None:
            o, kv_cache = self._attend(qkv, rows, table, kv_cache, md, positions, dtype=x.dtype)
        else:  # each device: its own heads (the fused projection's block) and its cache shard
            heads, cache = PartitionSpec(None, MODEL_AXIS), kv_cache_partition_spec(md.backend, MODEL_AXIS)
            whole = PartitionSpec()
            o, kv_cache = jax.shard_map(
                functools.partial(self._attend, dtype=x.dtype, devices=md.tp_size),
                mesh=md.mesh,
                in_specs=(heads, whole, whole, cache, whole, whole),
                out_specs=(heads, cache),
                check_vma=False,
            )(qkv, rows, table, kv_cache, dataclasses.replace(md, mesh=None), positions)
        return self.o_proj(o), kv_cache  # [T, D]

    def _attend(
        self,
        qkv: jax.Array,
        rows: jax.Array,
        table: jax.Array,
        kv_cache: jax.Array,
        md: AttentionMetadata,
        positions: jax.Array,
        *,
        dtype: jnp.dtype,
        devices: int = 1,
    ) -> tuple[jax.Array, jax.Array]:
        """The layer's q/k treatment, the KV write and attention on `qkv`'s heads (all, or one
        device's block with `devices > 1`). Returns `[T, n * H]` and the cache."""
        t, h = qkv.shape[0], self.head_dim
        n, k = self.num_heads // devices, self.num_kv_heads // devices
        q, key, v = split_heads(qkv, num_heads=n, num_kv_heads=k, head_dim=h, dtype=dtype)
        if self.use_rope:
            cos, sin = table_rows(table, rows)
            q, key = rotate_pairs(q, cos, sin), rotate_pairs(key, cos, sin)
        if self.l2_eps is not None:
            q, key = l2_norm(q, self.l2_eps), l2_norm(key, self.l2_eps)
        if self.temperature is not None:
            scales = temperature_scales(positions, *self.temperature)[:, None, None]
            q = (q.astype(jnp.float32) * scales).astype(dtype)
        cache_args = dict(backend=md.backend, kv_dtype=md.kv_dtype, first_page=md.first_page)
        kv_cache = write_kv(kv_cache, key, v, md.slot_mapping, **cache_args)
        o = ragged_paged_attention(
            q, kv_cache, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=self.sm_scale, attention_chunk_size=self.attention_chunk_size, **cache_args,
        )  # fmt: skip
        return o.reshape(t, n * h), kv_cache


class Llama4MoE(SparseMoE):
    """A shared SwiGLU expert plus the top-k routed ones: the router's chosen logits through a
    sigmoid scale each chosen expert's input."""

    weights_on_input = True

    def __init__(self, config: Llama4Config, *, dtype: jnp.dtype):
        f = config.moe_intermediate_size
        super().__init__(
            config.hidden_size, f, config.num_experts, config.num_experts_per_tok,
            renormalize=False, dtype=dtype, act=config.hidden_act,
        )  # fmt: skip
        self.shared_expert = GatedMLP(config.hidden_size, f, bias=False, dtype=dtype, act=config.hidden_act)

    def select_experts(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits, experts = jax.lax.top_k(self.router(x), self.top_k)  # [T, k]
        # The scores are rounded to the activations' dtype, as transformers does.
        weights = jax.nn.sigmoid(logits.astype(jnp.float32)).astype(x.dtype).astype(jnp.float32)
        return weights, experts.astype(jnp.int32)

    def __call__(
        self, x: jax.Array, md: AttentionMetadata | None = None, *, dense: bool = False
    ) -> jax.Array:
        return self.shared_expert(x, md) + super().__call__(x, md, dense=dense)


def _mlp(config: Llama4Config, layer: int, dtype: jnp.dtype) -> nnx.Module:
    if config.is_moe_layer(layer):
        return Llama4MoE(config, dtype=dtype)
    return GatedMLP.from_config(config, dtype=dtype)


def _per_expert(name: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """A stacked experts tensor as per-expert HF-style `[out, in]` weights (`{e}` entries)."""
    base = name.rsplit(".", 1)[0]
    if name.endswith("gate_up_proj"):  # [E, D, 2F]: gate columns, then up
        gate, up = np.split(np.asarray(array), 2, axis=-1)
        for e in range(gate.shape[0]):
            yield f"{base}.{e}.gate_proj.weight", gate[e].T
            yield f"{base}.{e}.up_proj.weight", up[e].T
    else:  # down_proj [E, F, D]
        for e, expert in enumerate(np.asarray(array)):
            yield f"{base}.{e}.down_proj.weight", expert.T


class Llama4ForCausalLM(CausalLM):
    hf_param_map = HF_PARAM_MAP

    def __init__(self, config: Llama4Config, *, dtype: jnp.dtype):
        layers = [
            DecoderLayer(config, Llama4Attention(config, i, dtype=dtype), _mlp(config, i, dtype), dtype=dtype)
            for i in range(config.num_layers)
        ]
        super().__init__(config, layers, dtype=dtype)

    def checkpoint_name(self, name: str) -> str | None:
        """The name `hf_param_map` reads a checkpoint tensor under: a multimodal checkpoint's
        `language_model.` prefix dropped, None for its other towers (`models.loader.model_name_rule`)."""
        return None if name.startswith(_NOT_TEXT) else name.removeprefix("language_model.")

    def checkpoint_tensors(self, tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors (renamed by `checkpoint_name`) with stacked experts split per
        expert (`models.loader.model_tensors` calls it)."""
        for name, array in tensors:
            if name.endswith((".feed_forward.experts.gate_up_proj", ".feed_forward.experts.down_proj")):
                yield from _per_expert(name, array)
            else:
                yield name, array
