# SPDX-License-Identifier: Apache-2.0
"""The Gated DeltaNet layer (Qwen3-Next's linear attention): a fixed-size recurrent state per
request instead of a KV cache that grows with the sequence.

Per token: one projection gives q, k (`linear_num_key_heads` heads of `linear_key_head_dim`), v
and the output gate z (`linear_num_value_heads` heads of `linear_value_head_dim`), laid out key
head by key head, `[q_g, k_g, v_g, z_g]`, each key head serving `Hv / Hk` value heads; another
gives b and a, one each a value head, laid out the same way. q, k and v pass a causal depthwise
conv1d (`linear_conv_kernel_dim` taps, silu) that continues from the request's last inputs; the
gated delta rule (`pallas_kernels.gated_delta`) runs with `beta = sigmoid(b)` and the log decay
`g = -exp(A_log) * softplus(a + dt_bias)`; each value head's output is RMS-normalized, scaled by
`weight` and gated by `silu(z)` before the output projection.

The layer's cache is the pair of its state pools `(conv [S, W - 1, 2 Hk Dk + Hv Dv], recurrent
[S, Hv, Dk, Dv])`; each sequence's slot is the first entry of its row of the layer's block table
(`md.page_indices[:, 0]`: the engine gives a linear-attention layer one block a request, its
state), and a sequence whose tokens before this step number zero starts from zeros. Under
speculative decoding with k drafts the engine gives it 1 + k blocks (`md.state_columns`): it
starts from the first, and a verification's rows leave the state after each of them in the
blocks in turn (`pallas_kernels.gated_delta`); the runner puts the block of the last row kept
first for the next step (`tpu_platform.state_cache.keep_accepted_states`).

Under tensor parallelism (`md.mesh`) each device runs whole key heads with their value heads:
the input projections are split on their output features (`models.sharding`; Qwen3-Next's are
laid out key head by key head, Qwen3.5's q, k and v come apart on load so that each splits on
its own heads), A_log and dt_bias on the value heads, the output projection on its inputs (one
sum a layer); the conv's small weight is whole on every device, each taking its own channels.
A device's slice of the conv pool holds its own `[q_i | k_i | v_i]` channels, of the recurrent
pool its own value heads (`pallas_kernels.state_partition_specs`), so the conv, the rule and the
gated norm run per device with no exchange.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from models.fused_outputs import FusedOutputs
from models.linear import Linear, zeros_param
from models.metadata import AttentionMetadata
from models.sharding import MODEL_AXIS
from pallas_kernels import allocate_state_pools, causal_conv1d, gated_delta_rule, state_partition_specs


class GatedRMSNorm(nnx.Module):
    """RMSNorm of each head's values, `weight * norm(x)` rounded to x's dtype, times `silu(z)`."""

    def __init__(self, size: int, *, eps: float, dtype: jnp.dtype):
        self.weight = zeros_param((size,), dtype)
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        scaled = (self.weight[...] * normed).astype(jnp.float32)
        return (scaled * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class DepthwiseConv(nnx.Module):
    """The conv1d's weight, as checkpoints hold it: `[channels, 1, taps]`."""

    def __init__(self, channels: int, taps: int, *, dtype: jnp.dtype):
        self.weight = zeros_param((channels, 1, taps), dtype)


class GatedDeltaNet(nnx.Module):
    """Qwen3-Next's linear-attention token mixer (module docstring): `x [T, D] -> [T, D]`.
    `SplitProjectionGatedDeltaNet` is Qwen3.5's, whose projections come apart."""

    def __init__(
        self,
        hidden_size: int,
        *,
        num_key_heads: int,
        num_value_heads: int,
        key_dim: int,
        value_dim: int,
        conv_width: int,
        eps: float,
        dtype: jnp.dtype,
    ):
        if num_value_heads % num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({num_key_heads})"
            )
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_dim, self.value_dim, self.conv_width = key_dim, value_dim, conv_width
        keys, values = num_key_heads * key_dim, num_value_heads * value_dim
        self.in_proj_qkvz = Linear(hidden_size, 2 * keys + 2 * values, bias=False, dtype=dtype)
        self.in_proj_ba = Linear(hidden_size, 2 * num_value_heads, bias=False, dtype=dtype)
        self.conv1d = DepthwiseConv(self.conv_dim, conv_width, dtype=dtype)
        self.A_log = zeros_param((num_value_heads,), jnp.float32)
        self.dt_bias = zeros_param((num_value_heads,), dtype)
        self.norm = GatedRMSNorm(value_dim, eps=eps, dtype=dtype)
        self.out_proj = Linear(values, hidden_size, bias=False, dtype=dtype)

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.num_key_heads * self.key_dim + self.num_value_heads * self.value_dim

    def allocate_state(self, num_slots: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """This layer's zeroed state pools for `num_slots` requests (conv inputs of `dtype`, the
        recurrent state in float32)."""
        return allocate_state_pools(
            num_slots, conv_width=self.conv_width, conv_dim=self.conv_dim, num_heads=self.num_value_heads,
            key_dim=self.key_dim, value_dim=self.value_dim, dtype=dtype,
        )  # fmt: skip

    def _project(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """The input projections' outputs `[T, out]` (on a mesh: each split on its features)."""
        return self.in_proj_qkvz(x), self.in_proj_ba(x)

    def _split_projections(
        self, projected: tuple[jax.Array, ...], num_key_heads: int, num_value_heads: int
    ) -> tuple[jax.Array, ...]:
        """`(qkv [T, conv channels], z [T, Hv, Dv], b [T, Hv], a [T, Hv])` of `num_key_heads` key
        heads (all, or one device's) from the per-key-head layout."""
        qkvz, ba = projected
        t, hk, dk, dv = qkvz.shape[0], num_key_heads, self.key_dim, self.value_dim
        per_key = num_value_heads // hk
        q, k, v, z = jnp.split(qkvz.reshape(t, hk, -1), [dk, 2 * dk, 2 * dk + per_key * dv], axis=-1)
        ba = ba.reshape(t, hk, 2 * per_key)
        b, a = ba[..., :per_key].reshape(t, -1), ba[..., per_key:].reshape(t, -1)
        qkv = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=-1)
        return qkv, z.reshape(t, -1, dv), b, a

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: tuple[jax.Array, jax.Array],
        md: AttentionMetadata,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        projected = self._project(x)
        args = (self.conv1d.weight[...], self.A_log[...], self.dt_bias[...])
        if md.mesh is None:
            o, cache = self._mix(projected, *args, cache, md)
        else:  # each device: its own key heads' features and its slices of the pools (module docstring)
            features, heads = PartitionSpec(None, MODEL_AXIS), PartitionSpec(MODEL_AXIS)
            pools, whole = state_partition_specs(MODEL_AXIS), PartitionSpec()
            o, cache = jax.shard_map(
                functools.partial(self._mix, devices=md.tp_size),
                mesh=md.mesh,
                in_specs=((features,) * len(projected), whole, heads, heads, pools, whole),
                out_specs=(features, pools),
                check_vma=False,
            )(projected, *args, cache, dataclasses.replace(md, mesh=None))
        return self.out_proj(o), cache  # [T, D]

    def _mix(
        self,
        projected: tuple[jax.Array, ...],
        conv_weight: jax.Array,
        a_log: jax.Array,
        dt_bias: jax.Array,
        cache: tuple[jax.Array, jax.Array],
        md: AttentionMetadata,
        *,
        devices: int = 1,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """The conv, the gated delta rule and the gated norm on all heads, or (`devices > 1`, under
        `shard_map`) on one device's: `projected`, `a_log`, `dt_bias` and the pools its slices.
        Returns the heads' outputs `[T, Hv * Dv]` (this device's) and the pools."""
        conv_state, state = cache
        hk, hv = self.num_key_heads // devices, self.num_value_heads // devices
        qkv, z, b, a = self._split_projections(projected, hk, hv)
        t, keys = qkv.shape[0], hk * self.key_dim
        slots = md.page_indices[:, 0] if md.state_columns == 1 else md.page_indices[:, : md.state_columns]
        q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
        has_state = md.kv_lens - q_lens > 0
        batch = (slots, has_state, md.cu_q_lens, md.num_seqs)
        weight = self._conv_channels(conv_weight[:, 0, :].T, devices)  # [W, channels]
        qkv, conv_state = causal_conv1d(qkv, weight, conv_state, *batch, backend=md.backend)
        q = qkv[:, :keys].reshape(t, hk, self.key_dim)
        k = qkv[:, keys : 2 * keys].reshape(t, hk, self.key_dim)
        v = qkv[:, 2 * keys :].reshape(t, hv, self.value_dim)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        dt = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(dt)
        o, state = gated_delta_rule(q, k, v, g, beta, state, *batch, backend=md.backend)
        o = self.norm(o.astype(z.dtype), z)  # [T, Hv, Dv]
        return o.reshape(t, -1), (conv_state, state)

    def _conv_channels(self, weight: jax.Array, devices: int) -> jax.Array:
        """The conv weight's columns `[W, channels]` of this device's q, k and v channels (all
        of them on one device): its slice of each of the three, side by side."""
        if devices == 1:
            return weight
        keys, values = self.num_key_heads * self.key_dim, self.num_value_heads * self.value_dim
        device = jax.lax.axis_index(MODEL_AXIS)
        slices = [
            jax.lax.dynamic_slice_in_dim(weight, start + device * width, width, axis=1)
            for start, width in ((0, keys // devices), (keys, keys // devices), (2 * keys, values // devices))
        ]
        return jnp.concatenate(slices, axis=1)


# Qwen3.5's q, k and v input projections, which checkpoints hold as one (`in_proj_qkv`).
_QKV = ("in_proj_q", "in_proj_k", "in_proj_v")


class SplitProjectionGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet: the same layer with its own projections of q, k and v (which
    checkpoints hold as one, `in_proj_qkv`, in the conv's `[q | k | v]` order, taken apart on
    load: `fused_qkv`), z, b and a."""

    def __init__(self, hidden_size: int, *, dtype: jnp.dtype, **shapes: int | float):
        super().__init__(hidden_size, dtype=dtype, **shapes)
        del self.in_proj_qkvz, self.in_proj_ba
        keys, heads = self.num_key_heads * self.key_dim, self.num_value_heads
        self.in_proj_q = Linear(hidden_size, keys, bias=False, dtype=dtype)
        self.in_proj_k = Linear(hidden_size, keys, bias=False, dtype=dtype)
        self.in_proj_v = Linear(hidden_size, heads * self.value_dim, bias=False, dtype=dtype)
        self.in_proj_z = Linear(hidden_size, heads * self.value_dim, bias=False, dtype=dtype)
        self.in_proj_b = Linear(hidden_size, heads, bias=False, dtype=dtype)
        self.in_proj_a = Linear(hidden_size, heads, bias=False, dtype=dtype)

    def _project(self, x: jax.Array) -> tuple[jax.Array, ...]:
        projections = (*_QKV, "in_proj_z", "in_proj_b", "in_proj_a")
        return tuple(getattr(self, name)(x) for name in projections)

    def _split_projections(
        self, projected: tuple[jax.Array, ...], num_key_heads: int, num_value_heads: int
    ) -> tuple[jax.Array, ...]:
        q, k, v, z, b, a = projected
        return jnp.concatenate([q, k, v], axis=-1), z.reshape(z.shape[0], num_value_heads, -1), b, a


def fused_qkv(keys: int, values: int) -> FusedOutputs:
    """Qwen3.5's `linear_attn.in_proj_qkv` (`keys`, `keys` and `values` outputs side by side) as
    our q, k and v projections, cut apart on load in every checkpoint format's own layout
    (`models.fused_outputs`)."""
    parts = tuple(f".linear_attn.{projection}" for projection in _QKV)
    return FusedOutputs(".linear_attn.in_proj_qkv", parts, (keys, keys, values))
