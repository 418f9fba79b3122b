# SPDX-License-Identifier: Apache-2.0
"""Shared building blocks: every model is assembled from these.

Each weight matrix is its own parameter (one pytree leaf): XLA:CPU copies slices of stacked
weights on every step, so stacking layers would cost a full weight copy per step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from models.config import ModelConfig
from models.linear import (
    Linear,
    PackedKernel,
    matmul,
    zeros_param,
)
from models.metadata import AttentionMetadata
from models.rope import Rope, RopeTable, apply_rope, step_rope_table
from models.sharding import MODEL_AXIS, repeat_kv_heads, vocab_parallel
from pallas_kernels import cpu, kv_cache_partition_spec, ragged_paged_attention, rope_write_kv, write_kv
from pallas_kernels.rope import split_heads, table_rows


class Embedding(nnx.Module):
    """Token embedding table `[V, D]`, also usable as a tied LM head.

    `scale` multiplies looked-up rows (Gemma: `sqrt(D)`, rounded to the table's dtype as HF does).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: jnp.dtype, scale: float | None = None):
        self.embedding = zeros_param((vocab_size, hidden_size), dtype)
        self.scale = scale
        self.head_kernel: HeadCopy | None = nnx.data(None)  # set by `transpose_for_head`
        self.head_scale: HeadCopy | None = nnx.data(None)  # an int8 head's (`models.quantization`)

    def __call__(self, ids: jax.Array, mesh: jax.sharding.Mesh | None = None) -> jax.Array:
        table = self.embedding[...]
        if mesh is not None and vocab_parallel(table.shape[0], mesh.shape[MODEL_AXIS]):
            x = jax.shard_map(
                _vocab_parallel_lookup,
                mesh=mesh,
                in_specs=(PartitionSpec(MODEL_AXIS, None), PartitionSpec()),
                out_specs=PartitionSpec(),
            )(table, ids)
        else:
            x = jnp.take(table, ids, axis=0)  # [T, D]
        return x if self.scale is None else x * jnp.asarray(self.scale, x.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: float32 logits `[T, V]`, from the `[D, V]` copy once `transpose_for_head` ran."""
        if self.head_kernel is not None:
            return matmul(x, self.head_kernel, self.head_scale)
        return jnp.einsum("td,vd->tv", x, self.embedding[...], preferred_element_type=jnp.float32)

    def transpose_for_head(self) -> None:
        """Keeps a `[D, V]` copy of the table for the head: the fast dot orientation on CPU."""
        self.head_kernel = HeadCopy(self.embedding[...].T)


def _vocab_parallel_lookup(rows: jax.Array, ids: jax.Array) -> jax.Array:
    """One device's part of an embedding lookup: its `[V / N, D]` rows of the table, zeros for
    ids elsewhere, summed over the devices (one row is non-zero per id, so the sum is exact)."""
    size = rows.shape[0]
    local = ids - jax.lax.axis_index(MODEL_AXIS) * size
    mine = (local >= 0) & (local < size)
    x = jnp.take(rows, jnp.clip(local, 0, size - 1), axis=0)
    return jax.lax.psum(jnp.where(mine[:, None], x, jnp.zeros((), x.dtype)), MODEL_AXIS)


class HeadCopy(nnx.Variable):
    """A derived copy of a parameter (not loaded from checkpoints)."""


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in float32, `x * w` (or `x * (1 + w)` when offset)."""

    def __init__(self, size: int, *, eps: float, dtype: jnp.dtype, unit_offset: bool = False):
        self.weight = zeros_param((size,), dtype)
        self.eps = eps
        self.unit_offset = unit_offset
        self.native = False  # one native call (`pallas_kernels.cpu.rms_norm`): `use_native_norms`

    def __call__(self, x: jax.Array) -> jax.Array:
        norm = cpu.rms_norm if self._runs_native(x) else cpu.rms_norm_reference
        return norm(x, self.weight[...], **self._options())

    def add_and_norm(self, x: jax.Array, residual: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`(self(x + residual), x + residual)`: a pre-norm block's residual add and the next norm,
        one native call where the norm runs native."""
        if self._runs_native(x) and residual.dtype == x.dtype:
            return cpu.add_rms_norm(x, residual, self.weight[...], **self._options())
        total = x + residual
        return self(total), total

    def _options(self) -> dict:
        # the layers' weights stacked: `models.layer_stacks`
        return dict(eps=self.eps, unit_offset=self.unit_offset, layer=getattr(self, "layer_index", None))

    def _runs_native(self, x: jax.Array) -> bool:
        return self.native and cpu.norm_takes(x, self.weight[...])


class PagedAttention(nnx.Module):
    """Grouped-query self-attention over the paged KV cache, with RoPE.

    Options cover every supported architecture: q/k/v and output biases (default
    `config.attention_bias`), RMSNorm of each q/k head before RoPE (Qwen3, Gemma 3; `(1 + w)` with
    `norm_unit_offset`), the softmax scale (default `H ** -0.5`), tanh soft-capping of the scores,
    a sliding window, the layer's RoPE (default `config.rope_theta` / `config.rope_scaling`), the
    dimensions it rotates (`rotary_dim`, default all H: GLM-4.5 rotates the first half) and
    attention sinks (GPT-OSS: a learned logit per query head in the softmax denominator, `[N]`).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: jnp.dtype,
        sliding_window: int | None = None,
        qkv_bias: bool | None = None,
        out_bias: bool | None = None,
        qk_norm: bool = False,
        norm_unit_offset: bool = False,
        sm_scale: float | None = None,
        soft_cap: float | None = None,
        rope: Rope | None = None,
        rotary_dim: int | None = None,
        sinks: bool = False,
    ):
        d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        qkv_bias = config.attention_bias if qkv_bias is None else qkv_bias
        out_bias = config.attention_bias if out_bias is None else out_bias
        self.q_proj = Linear(d, n * h, bias=qkv_bias, dtype=dtype)
        self.k_proj = Linear(d, k * h, bias=qkv_bias, dtype=dtype)
        self.v_proj = Linear(d, k * h, bias=qkv_bias, dtype=dtype)
        self.qkv_proj: Linear | None = nnx.data(None)  # replaces the three: `fuse_projections`
        self.o_proj = Linear(n * h, d, bias=out_bias, dtype=dtype)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(h, eps=eps, dtype=dtype, unit_offset=norm_unit_offset) if qk_norm else None
        self.k_norm = RMSNorm(h, eps=eps, dtype=dtype, unit_offset=norm_unit_offset) if qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.rope = rope or Rope(config.rope_theta, config.rope_scaling)
        self.rotary_dim = h if rotary_dim is None else rotary_dim
        self.rope_table: RopeTable | None = nnx.data(None)  # set by `attach_rope_tables`
        self.sliding_window = sliding_window
        self.sm_scale = h**-0.5 if sm_scale is None else sm_scale
        self.soft_cap = soft_cap
        self.sinks = zeros_param((n,), dtype) if sinks else None

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        qkv = self._project_qkv(x)  # [T, (N + 2K) * H]
        inv_freq = self.rope.inverse_frequencies(self.rotary_dim)
        table, rows = step_rope_table(positions, inv_freq, self.rope_table, self.rope.attention_factor)
        sinks = None if self.sinks is None else self.sinks[...].astype(jnp.float32)  # [N]
        # The q and k norms go in as arguments, not read from `self` inside: a per-device body
        # that closes over a weight cannot run inside another `shard_map` (data-parallel replicas
        # of several devices each, `tpu_platform.replica_step`).
        norms = None if self.q_norm is None else (self.q_norm, self.k_norm)
        if md.mesh is None:
            o, kv_cache = self._attend(qkv, rows, table, kv_cache, md, sinks, norms, dtype=x.dtype)
        else:  # each device: its own heads (the fused projection's block, their sinks) and its cache shard
            heads, cache = PartitionSpec(None, MODEL_AXIS), kv_cache_partition_spec(md.backend, MODEL_AXIS)
            whole = PartitionSpec()
            o, kv_cache = jax.shard_map(
                functools.partial(self._attend, dtype=x.dtype, devices=md.tp_size),
                mesh=md.mesh,
                in_specs=(heads, whole, whole, cache, whole, PartitionSpec(MODEL_AXIS), whole),
                out_specs=(heads, cache),
                check_vma=False,
            )(qkv, rows, table, kv_cache, dataclasses.replace(md, mesh=None), sinks, norms)
        return self.o_proj(self.gate_output(o, x)), kv_cache  # [T, D]

    def gate_output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """The heads' output `o [T, N * H]` as `o_proj` takes it: as is (a gated attention,
        Qwen3-Next's, scales it by a gate computed from the layer's input `x`)."""
        return o

    def _attend(
        self,
        qkv: jax.Array,
        rows: jax.Array,
        table: jax.Array,
        kv_cache: jax.Array,
        md: AttentionMetadata,
        sinks: jax.Array | None = None,
        norms: tuple[RMSNorm, RMSNorm] | None = None,
        *,
        dtype: jnp.dtype,
        devices: int = 1,
    ) -> tuple[jax.Array, jax.Array]:
        """RoPE, the KV write and attention on `qkv`'s heads: all of them, or (`devices > 1`)
        one device's `[q_i, k_i, v_i]` block and cache shard; `norms`: the q and k heads' RMSNorms
        before the rotation. Returns `[T, n * H]` and the cache."""
        t, h = qkv.shape[0], self.head_dim
        n, k = self.num_heads // devices, self.num_kv_heads // devices
        heads = dict(num_heads=n, num_kv_heads=k)
        cache_args = dict(backend=md.backend, kv_dtype=md.kv_dtype, first_page=md.first_page)
        if norms is None and self.rotary_dim == h:
            q, kv_cache = rope_write_kv(
                qkv, rows, table, kv_cache, md.slot_mapping, dtype=dtype, **heads, **cache_args
            )
        else:  # RMSNorm of each q and k head before the rotation, or a partial rotation
            q, key, v = split_heads(qkv, head_dim=h, dtype=dtype, **heads)
            if norms is not None:
                q, key = norms[0](q), norms[1](key)
            cos, sin = table_rows(table, rows)
            q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
            kv_cache = write_kv(kv_cache, key, v, md.slot_mapping, **cache_args)
        o = ragged_paged_attention(
            q, kv_cache, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=self.sm_scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap,
            sinks=sinks, **cache_args,
        )  # fmt: skip
        return o.reshape(t, n * h), kv_cache

    def _project_qkv(self, x: jax.Array) -> jax.Array:
        """The q, k and v heads side by side, `[T, (N + 2K) * H]`: the fused projection's float32
        products when it has no bias (`rope_write_kv` rounds them to the activations' dtype), else
        values of `x`'s dtype."""
        if self.qkv_proj is None:
            return jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        if self.qkv_proj.bias is None:
            return self.qkv_proj.product(x)
        return self.qkv_proj(x)

    def fuse_projections(self, blocks: int = 1) -> None:
        """Replaces the q, k and v projections by one (after loading: checkpoints name the three),
        in `blocks` `[q_i, k_i, v_i]` blocks of whole heads (one a device of a mesh that size)."""
        self.qkv_proj = Linear.concatenated([self.q_proj, self.k_proj, self.v_proj], blocks)
        del self.q_proj, self.k_proj, self.v_proj

    def repeat_kv_heads(self, repeats: int) -> None:
        """Repeats each KV head `repeats` times in the k and v projections (before fusing): a
        mesh of more devices than KV heads gives every device a copy of its group's head."""
        if repeats == 1:
            return
        for linear in (self.k_proj, self.v_proj):
            for name in ("kernel", "bias", "kernel_scale", "kernel_offset"):  # output features last in each
                param = getattr(linear, name)
                if param is not None:
                    value = param[...]
                    param.set_value(repeat_kv_heads(value, self.num_kv_heads, repeats, axis=value.ndim - 1))
        self.num_kv_heads *= repeats


_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The elementwise function of HF's `hidden_act` name, or a ValueError listing the known ones."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}") from None


class GatedMLP(nnx.Module):
    """Gated MLP: `down(act(gate(x)) * up(x))` (SwiGLU with silu, GeGLU with gelu)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, bias: bool, dtype: jnp.dtype, act: str = "silu"
    ):
        activation(act)  # fail at build time on an unknown name
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
        self.gate_up_proj: Linear | None = nnx.data(None)  # replaces gate and up: `fuse_projections`
        self.blocks = 1  # of `gate_up_proj`'s columns: `fuse_projections`
        self.act = act

    @classmethod
    def from_config(cls, config: ModelConfig, *, dtype: jnp.dtype) -> GatedMLP:
        """The dense MLP of `config`: `intermediate_size`, `mlp_bias`, `hidden_act`."""
        return cls(
            config.hidden_size,
            config.intermediate_size,
            bias=config.mlp_bias,
            dtype=dtype,
            act=config.hidden_act,
        )

    def __call__(self, x: jax.Array, md: AttentionMetadata | None = None) -> jax.Array:
        """`md` is the step's metadata every MLP is given; a dense MLP's sharded sums are XLA's own."""
        if self._native_silu():
            return self.down_proj(cpu.silu_and_mul(self.gate_up_proj.product(x), dtype=x.dtype))
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        elif self.blocks == 1:
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        else:  # `[gate_i, up_i]` blocks (one a device): a reshape keeps each device's own columns
            t = x.shape[0]
            blocks = self.gate_up_proj(x).reshape(t, self.blocks, 2, -1)
            gate, up = blocks[:, :, 0].reshape(t, -1), blocks[:, :, 1].reshape(t, -1)
        return self.down_proj(activation(self.act)(gate) * up)

    def _native_silu(self) -> bool:
        """Whether `silu(gate) * up` runs as one native call (`pallas_kernels.cpu.silu_and_mul`): a
        SwiGLU whose fused projection, without a bias, runs on the native dense kernel."""
        fused = self.gate_up_proj
        return (
            self.act in ("silu", "swish")
            and fused is not None
            and fused.bias is None
            and isinstance(fused.kernel, PackedKernel)
        )

    def fuse_projections(self, blocks: int = 1) -> None:
        """Replaces the gate and up projections by one (after loading: checkpoints name both), in
        `blocks` `[gate_i, up_i]` blocks (one a device of a mesh that size)."""
        self.gate_up_proj = Linear.concatenated([self.gate_proj, self.up_proj], blocks)
        self.blocks = blocks
        del self.gate_proj, self.up_proj


class DecoderLayer(nnx.Module):
    """Pre-norm block (Llama, Qwen, Mistral, Mixtral): `x += attn(norm(x)); x += mlp(norm(x))`."""

    def __init__(self, config: ModelConfig, self_attn: PagedAttention, mlp: nnx.Module, *, dtype: jnp.dtype):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = mlp

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        attn, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        normed, x = self.post_attention_layernorm.add_and_norm(x, attn)
        return x + self.mlp(normed, md), kv_cache


class SandwichDecoderLayer(nnx.Module):
    """Gemma 2/3 block: `(1 + w)` RMSNorms both before and after attention and the MLP."""

    def __init__(self, config: ModelConfig, self_attn: PagedAttention, mlp: nnx.Module, *, dtype: jnp.dtype):
        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, unit_offset=True)

        self.input_layernorm = norm()
        self.self_attn = self_attn
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = norm()

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        attn, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x), md)
        return x + self.post_feedforward_layernorm(mlp), kv_cache


class DecoderModel(nnx.Module):
    """The trunk every decoder-only model shares: `embed_tokens -> layers -> norm`."""

    def __init__(
        self,
        config: ModelConfig,
        layers: Sequence[nnx.Module],
        *,
        dtype: jnp.dtype,
        embed_scale: float | None = None,
        norm_unit_offset: bool = False,
    ):
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, scale=embed_scale)
        self.layers = nnx.List(layers)
        eps = config.rms_norm_eps
        self.norm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype, unit_offset=norm_unit_offset)

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_caches: list[jax.Array],
        md: AttentionMetadata,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[jax.Array, list[jax.Array]] | tuple[jax.Array, list[jax.Array], jax.Array]:
        """`(hidden, kv_caches)`; with `aux_layers` (an EAGLE-3 head's), also the residual stream
        entering each of those layers (index `len(layers)`: the last one's output), side by side
        in layer order: `[T, len(aux_layers) * D]`."""
        x = self.embed_tokens(input_ids, md.mesh)  # [T, D]
        # Padding tokens start from zeros. Norms, RoPE, attention (it leaves padding rows at zero)
        # and projections without a bias keep a zero row zero, so the CPU's dense kernels skip
        # those rows (`pallas_kernels.cpu.native_dense`); a bias on the residual path ends that.
        x = jnp.where(md.real_tokens(x.shape[0])[:, None], x, jnp.zeros((), x.dtype))
        kv_caches = list(kv_caches)
        aux = []
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux.append(x)
            cache, layer_md = md.for_layer(i)  # layers of different KV groups may share an array
            x, kv_caches[cache] = layer(x, positions, kv_caches[cache], layer_md)
        if not aux_layers:
            return self.norm(x), kv_caches
        if len(self.layers) in aux_layers:
            aux.append(x)
        return self.norm(x), kv_caches, jnp.concatenate(aux, axis=-1)


class CausalLM(nnx.Module):
    """A `DecoderModel` under an LM head (tied to the embedding or not); the base of every model.

    Subclasses build their layers and set `hf_param_map` (HF checkpoint name -> our parameter path).
    `final_soft_cap` tanh-caps the logits (Gemma 2/3).
    """

    hf_param_map: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        config: ModelConfig,
        layers: Sequence[nnx.Module],
        *,
        dtype: jnp.dtype,
        embed_scale: float | None = None,
        norm_unit_offset: bool = False,
        final_soft_cap: float | None = None,
    ):
        self.config = config
        self.model = DecoderModel(
            config, layers, dtype=dtype, embed_scale=embed_scale, norm_unit_offset=norm_unit_offset
        )
        tied = config.tie_word_embeddings
        self.lm_head = (
            None if tied else Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        )
        self.final_soft_cap = final_soft_cap

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_caches: list[jax.Array],
        md: AttentionMetadata,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[jax.Array, list[jax.Array]] | tuple[jax.Array, list[jax.Array], jax.Array]:
        """The trunk's `(hidden, kv_caches)`, and with `aux_layers` the hidden states an EAGLE-3
        head reads (`DecoderModel.__call__`); trunks without the option (Gemma 4's) are called
        without it."""
        if aux_layers:
            return self.model(input_ids, positions, kv_caches, md, aux_layers)
        return self.model(input_ids, positions, kv_caches, md)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """`[R, D]` hidden states to float32 logits `[R, V]`."""
        if self.lm_head is None:
            logits = self.model.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head.product(hidden)
        if self.final_soft_cap is not None:
            logits = self.final_soft_cap * jnp.tanh(logits / self.final_soft_cap)
        return logits


ATTENTION_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_LINEARS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def decoder_hf_param_map(*, linears: Iterable[str], norms: Iterable[str]) -> dict[str, str]:
    """HF names -> ours for the trunk and the given per-layer modules (paths under `model.layers.{i}.`,
    spelled as in HF, which ours mirror). A Linear's HF `weight` `[out, in]` fills our `kernel`
    (transposed on load) and its `bias` our `bias`; a norm's `weight` fills our `weight`."""
    table = {
        "model.embed_tokens.weight": "model.embed_tokens.embedding",
        "model.norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.kernel",
    }
    layer = "model.layers.{i}"
    for name in linears:
        table[f"{layer}.{name}.weight"] = f"{layer}.{name}.kernel"
        table[f"{layer}.{name}.bias"] = f"{layer}.{name}.bias"
    for name in norms:
        table[f"{layer}.{name}.weight"] = f"{layer}.{name}.weight"
    return table
