# SPDX-License-Identifier: Apache-2.0
"""Gemma 4 (text, `Gemma4ForCausalLM`): sliding and full layers of different head dims and KV
heads (`models.gemma4_config`), RMSNorms (`x * w`, no unit offset) over each q and k head and a
scale-free one over each v head, softmax scale 1, full layers' proportional RoPE and, where
`attention_k_eq_v`, their keys reused as values; sandwich norms around attention and the GeGLU
MLP, per-layer input embeddings (a `[V, L * P]` table plus a projection of the embeddings,
gating a residual branch in each layer), a learned scalar on each layer's output, KV-shared
layers reading an earlier layer's cache, and final logit soft-capping.

The MoE block (`enable_moe_block`, gemma-4-26B-A4B) runs beside each layer's dense MLP: a router
over the block's input (RMS-normalised without a weight, times a learned `[D]` scale and
`D ** -0.5`; softmax over every expert, the top k renormalized, each times its expert's learned
scale) picks GeGLU experts that read the input through their own norm; the MLP's and the
experts' outputs, each normed, are summed before the block's post-MLP norm. Checkpoints hold
the experts stacked, `experts.gate_up_proj [E, 2F, D]` (gate rows, then up) and
`experts.down_proj [E, D, F]`, both `[out, in]` per expert; they are read into the shared
per-expert stacks of `models.moe` (so tensor and expert parallelism, int8, fp8 and int4 experts
and per-expert checkpoints work as for every other MoE).

`Gemma4ForConditionalGeneration` (the released checkpoints) serves its text model: image and
audio inputs are refused at start (`plugin_shim.feature_check`), and its towers are not read.

Not built (refused when the config asks, `gemma4_config`): bidirectional attention. Every
layer's cache is the widest layer's shape (`gemma4_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from models.gemma4_config import Gemma4Config
from models.layers import (
    ATTENTION_LINEARS,
    MLP_LINEARS,
    CausalLM,
    Embedding,
    GatedMLP,
    RMSNorm,
    activation,
    decoder_hf_param_map,
)
from models.linear import Linear, zeros_param
from models.metadata import AttentionMetadata
from models.moe import SparseMoE
from models.rope import apply_rope, rope_cos_sin
from models.sharding import MODEL_AXIS, kv_heads_on_mesh
from pallas_kernels import kv_cache_partition_spec, ragged_paged_attention, write_kv

_LAYER = "model.layers.{i}"
_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "post_per_layer_input_norm",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_1",
    "post_feedforward_layernorm_2",
)
_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# HF checkpoint name -> our parameter path ("{i}" is the layer index).
HF_PARAM_MAP = {
    **decoder_hf_param_map(
        linears=(*ATTENTION_LINEARS, *MLP_LINEARS, "per_layer_input_gate", "per_layer_projection"),
        norms=_NORMS,
    ),
    f"{_LAYER}.layer_scalar": f"{_LAYER}.layer_scalar",
    "model.embed_tokens_per_layer.weight": "model.per_layer_inputs.embed_tokens_per_layer.embedding",
    "model.per_layer_model_projection.weight": "model.per_layer_inputs.per_layer_model_projection.kernel",
    "model.per_layer_projection_norm.weight": "model.per_layer_inputs.per_layer_projection_norm.weight",
    # The MoE block ("{e}": one expert's tensor, `checkpoint_tensors` splits the stacked ones).
    f"{_LAYER}.router.proj.weight": f"{_LAYER}.moe.router.kernel",
    f"{_LAYER}.router.scale": f"{_LAYER}.moe.router_scale",
    f"{_LAYER}.router.per_expert_scale": f"{_LAYER}.moe.per_expert_scale",
    **{f"{_LAYER}.experts.{{e}}.{p}.weight": f"{_LAYER}.moe.experts.{p}.kernel" for p in _EXPERT_PROJECTIONS},
}


def rms(x: jax.Array, eps: float) -> jax.Array:
    """RMS normalisation without a weight, in float32 (the v heads' norm)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def widen(x: jax.Array, heads: int, head_dim: int) -> jax.Array:
    """`[T, k, h]` -> `[T, heads, head_dim]`: each head repeated `heads // k` times in place
    (query head n still meets its KV head n // (N / heads)), zeros past `h`."""
    x = jnp.repeat(x, heads // x.shape[1], axis=1)
    return jnp.pad(x, ((0, 0), (0, 0), (0, head_dim - x.shape[2])))


# A Gemma4ForConditionalGeneration checkpoint: the text model's prefix, and the towers not read.
_MULTIMODAL_TEXT = "model.language_model."
_NOT_TEXT = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


class Gemma4Attention(nnx.Module):
    """One layer's attention over a cache of the model's widest shape (`Gemma4Config`): q, k
    (and v) heads of this layer's head dim, RMSNormed, rotated, widened to the cache's shape,
    written (unless the layer reads another layer's cache) and attended with softmax scale 1."""

    def __init__(self, config: Gemma4Config, layer: int, *, dtype: jnp.dtype):
        d, n, eps = config.hidden_size, config.num_heads, config.rms_norm_eps
        h, k = config.layer_head_dims[layer], config.layer_kv_heads[layer]
        bias = config.attention_bias
        self.q_proj = Linear(d, n * h, bias=bias, dtype=dtype)
        self.q_norm = RMSNorm(h, eps=eps, dtype=dtype)
        self.k_proj: Linear | None = nnx.data(None)
        self.v_proj: Linear | None = nnx.data(None)
        self.k_norm: RMSNorm | None = nnx.data(None)
        if layer < config.first_kv_shared_layer:  # a KV-shared layer has no k or v of its own
            self.k_proj = Linear(d, k * h, bias=bias, dtype=dtype)
            self.k_norm = RMSNorm(h, eps=eps, dtype=dtype)
            if not (config.attention_k_eq_v and config.is_full(layer)):
                self.v_proj = Linear(d, k * h, bias=bias, dtype=dtype)
        self.o_proj = Linear(n * h, d, bias=bias, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.cache_kv_heads, self.cache_head_dim = config.num_kv_heads, config.head_dim
        self.eps = eps
        self.rope = config.layer_rope(layer)
        self.sliding_window = config.layer_sliding_windows[layer]

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        t, n, h = x.shape[0], self.num_heads, self.head_dim
        cos, sin = rope_cos_sin(positions, self.rope.inverse_frequencies(h))  # [T, H/2]
        q = apply_rope(self.q_norm(self.q_proj(x).reshape(t, n, h)), cos, sin)
        q = widen(q, n, self.cache_head_dim)  # [T, N, Hc]
        kv = None
        if self.k_proj is not None:
            heads = kv_heads_on_mesh(n, self.cache_kv_heads, md.tp_size)
            key = self.k_proj(x).reshape(t, self.num_kv_heads, h)
            value = key if self.v_proj is None else self.v_proj(x).reshape(t, self.num_kv_heads, h)
            key = apply_rope(self.k_norm(key), cos, sin)
            kv = (
                widen(key, heads, self.cache_head_dim),
                widen(rms(value, self.eps), heads, self.cache_head_dim),
            )
        if md.mesh is None:
            o, kv_cache = self._attend(q, kv_cache, md, kv)
        else:  # each device: its own query and KV heads and its shard of the cache
            heads_spec = PartitionSpec(None, MODEL_AXIS, None)
            cache_spec = kv_cache_partition_spec(md.backend, MODEL_AXIS)
            kv_spec = None if kv is None else (heads_spec, heads_spec)
            o, kv_cache = jax.shard_map(
                self._attend,
                mesh=md.mesh,
                in_specs=(heads_spec, cache_spec, PartitionSpec(), kv_spec),
                out_specs=(heads_spec, cache_spec),
                check_vma=False,
            )(q, kv_cache, dataclasses.replace(md, mesh=None), kv)
        return self.o_proj(o[:, :, :h].reshape(t, n * h)), kv_cache  # [T, D]

    def _attend(
        self,
        q: jax.Array,
        kv_cache: jax.Array,
        md: AttentionMetadata,
        kv: tuple[jax.Array, jax.Array] | None,
    ) -> tuple[jax.Array, jax.Array]:
        cache_args = dict(backend=md.backend, kv_dtype=md.kv_dtype, first_page=md.first_page)
        if kv is not None:
            kv_cache = write_kv(kv_cache, *kv, md.slot_mapping, **cache_args)
        o = ragged_paged_attention(
            q, kv_cache, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=1.0, sliding_window=self.sliding_window, **cache_args,
        )  # fmt: skip
        return o, kv_cache


class Gemma4MoE(SparseMoE):
    """Gemma 4's routed experts (`models.moe`'s stacks, GeGLU): `__call__(router_input,
    expert_input)`, the router reading the block's input and the experts its
    `pre_feedforward_layernorm_2` norm."""

    def __init__(self, config: Gemma4Config, *, dtype: jnp.dtype):
        d, e = config.hidden_size, config.num_experts
        super().__init__(
            d, config.moe_intermediate_size, e, config.num_experts_per_tok,
            renormalize=True, dtype=dtype, act=config.hidden_act,
        )  # fmt: skip
        self.router_scale = zeros_param((d,), dtype)
        self.per_expert_scale = zeros_param((e,), dtype)
        self.eps, self.hidden_size = config.rms_norm_eps, d

    def select_experts(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Weights `[T, k]` (float32: the renormalized top-k softmax times each chosen expert's
        scale) and expert ids `[T, k]` for the block's input `x [T, D]`."""
        scale = self.router_scale[...] * jnp.asarray(self.hidden_size**-0.5, x.dtype)
        weights, experts = super().select_experts(rms(x, self.eps) * scale)
        return weights * self.per_expert_scale[...][experts].astype(jnp.float32), experts

    def __call__(  # type: ignore[override]
        self,
        router_input: jax.Array,
        expert_input: jax.Array,
        md: AttentionMetadata | None = None,
        *,
        dense: bool = False,
    ) -> jax.Array:
        return self.run_experts(expert_input, *self.select_experts(router_input), md, dense=dense)


def _per_expert(name: str, array: Any) -> Iterator[tuple[str, np.ndarray]]:
    """A stacked experts tensor as per-expert `[out, in]` weights (`{e}` entries):
    `gate_up_proj [E, 2F, D]` (gate rows, then up), `down_proj [E, D, F]`."""
    base, array = name.rsplit(".", 1)[0], np.asarray(array)
    if name.endswith("gate_up_proj"):
        gate, up = np.split(array, 2, axis=1)
        for e in range(array.shape[0]):
            yield f"{base}.{e}.gate_proj.weight", gate[e]
            yield f"{base}.{e}.up_proj.weight", up[e]
    else:
        for e, expert in enumerate(array):
            yield f"{base}.{e}.down_proj.weight", expert


class Gemma4DecoderLayer(nnx.Module):
    """Sandwich-normed attention and MLP (with the MoE block: the MLP's and the experts'
    outputs, each normed, summed), then the per-layer input branch
    `x += norm(proj(act(gate(x)) * per_layer_input))`, all times the layer's scalar."""

    def __init__(self, config: Gemma4Config, layer: int, *, dtype: jnp.dtype):
        d, eps = config.hidden_size, config.rms_norm_eps

        def norm() -> RMSNorm:
            return RMSNorm(d, eps=eps, dtype=dtype)

        self.input_layernorm = norm()
        self.self_attn = Gemma4Attention(config, layer, dtype=dtype)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(d, config.mlp_size(layer), bias=False, dtype=dtype, act=config.hidden_act)
        self.post_feedforward_layernorm = norm()
        self.moe = Gemma4MoE(config, dtype=dtype) if config.num_experts else None
        moe = bool(config.num_experts)
        self.pre_feedforward_layernorm_2 = norm() if moe else None
        self.post_feedforward_layernorm_1 = norm() if moe else None
        self.post_feedforward_layernorm_2 = norm() if moe else None
        p = config.per_layer_input_size
        self.per_layer_input_gate = Linear(d, p, bias=False, dtype=dtype) if p else None
        self.per_layer_projection = Linear(p, d, bias=False, dtype=dtype) if p else None
        self.post_per_layer_input_norm = norm() if p else None
        self.layer_scalar = zeros_param((1,), dtype)
        self.act = config.hidden_act

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        kv_cache: jax.Array,
        md: AttentionMetadata,
        per_layer_input: jax.Array | None,
    ) -> tuple[jax.Array, jax.Array]:
        attn, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x), md)  # [T, D]
        if self.moe is not None:
            routed = self.moe(x, self.pre_feedforward_layernorm_2(x), md)  # [T, D]
            mlp = self.post_feedforward_layernorm_1(mlp) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(mlp)
        if per_layer_input is not None:
            gate = activation(self.act)(self.per_layer_input_gate(x)) * per_layer_input  # [T, P]
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar[...], kv_cache


class PerLayerInputs(nnx.Module):
    """Each layer's `[P]` input: `(norm(proj(e) / sqrt(D)) + table[id] * sqrt(P)) / sqrt(2)`,
    `e` the token's scaled embedding, `proj` `[D, L * P]`, the table `[V, L * P]`."""

    def __init__(self, config: Gemma4Config, *, dtype: jnp.dtype):
        p, layers = config.per_layer_input_size, config.num_layers
        self.embed_tokens_per_layer = Embedding(
            config.per_layer_vocab_size, layers * p, dtype=dtype, scale=p**0.5
        )
        self.per_layer_model_projection = Linear(config.hidden_size, layers * p, bias=False, dtype=dtype)
        self.per_layer_projection_norm = RMSNorm(p, eps=config.rms_norm_eps, dtype=dtype)
        self.num_layers, self.size, self.hidden_size = layers, p, config.hidden_size

    def __call__(self, ids: jax.Array, embeds: jax.Array, md: AttentionMetadata) -> jax.Array:
        """`[T, L, P]` for token ids `[T]` and their scaled embeddings `[T, D]`."""
        t = ids.shape[0]
        projected = self.per_layer_model_projection(embeds) * jnp.asarray(
            self.hidden_size**-0.5, embeds.dtype
        )
        projected = self.per_layer_projection_norm(projected.reshape(t, self.num_layers, self.size))
        tokens = self.embed_tokens_per_layer(ids, md.mesh).reshape(t, self.num_layers, self.size)
        return (projected + tokens) * jnp.asarray(2.0**-0.5, embeds.dtype)


class Gemma4Model(nnx.Module):
    """`embed_tokens -> layers -> norm`, each layer given its per-layer input and the cache of
    its KV source layer (`Gemma4Config.kv_source`)."""

    def __init__(self, config: Gemma4Config, *, dtype: jnp.dtype):
        d = config.hidden_size
        self.embed_tokens = Embedding(config.vocab_size, d, dtype=dtype, scale=d**0.5)
        self.per_layer_inputs = PerLayerInputs(config, dtype=dtype) if config.per_layer_input_size else None
        self.layers = nnx.List([Gemma4DecoderLayer(config, i, dtype=dtype) for i in range(config.num_layers)])
        self.norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype)
        self.kv_sources = tuple(config.kv_source(i) for i in range(config.num_layers))

    def __call__(
        self, input_ids: jax.Array, positions: jax.Array, kv_caches: list[jax.Array], md: AttentionMetadata
    ) -> tuple[jax.Array, list[jax.Array]]:
        x = self.embed_tokens(input_ids, md.mesh)  # [T, D]
        x = jnp.where(md.real_tokens(x.shape[0])[:, None], x, jnp.zeros((), x.dtype))
        per_layer = None if self.per_layer_inputs is None else self.per_layer_inputs(input_ids, x, md)
        kv_caches = list(kv_caches)
        for i, layer in enumerate(self.layers):
            cache, layer_md = md.for_layer(self.kv_sources[i])
            layer_input = None if per_layer is None else per_layer[:, i]
            x, kv_caches[cache] = layer(x, positions, kv_caches[cache], layer_md, layer_input)
        return self.norm(x), kv_caches


class Gemma4ForCausalLM(CausalLM):
    hf_param_map = HF_PARAM_MAP
    lora_refused = "LoRA adapters are not supported on Gemma 4 by vllm-xla yet; serve it without enable_lora"

    def __init__(self, config: Gemma4Config, *, dtype: jnp.dtype):
        self.config = config
        self.model = Gemma4Model(config, dtype=dtype)
        tied = config.tie_word_embeddings
        self.lm_head = (
            None if tied else Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        )
        self.final_soft_cap = config.final_logit_softcap

    def checkpoint_name(self, name: str) -> str | None:
        """The name `hf_param_map` reads a checkpoint tensor under: a multimodal checkpoint's
        `model.language_model.` prefix read as `model.`, None for its vision and audio towers
        and their embedders (`models.loader.model_name_rule`)."""
        if name.startswith(_NOT_TEXT):
            return None
        return "model." + name.removeprefix(_MULTIMODAL_TEXT) if name.startswith(_MULTIMODAL_TEXT) else name

    def checkpoint_tensors(self, tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors (renamed by `checkpoint_name`) with the MoE block's stacked
        experts split per expert (`models.loader.model_tensors` calls it)."""
        for name, array in tensors:
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                yield from _per_expert(name, array)
            else:
                yield name, array
