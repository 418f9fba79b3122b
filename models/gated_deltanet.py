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
state), and a sequence whose tokens before this step number zero starts from zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.linear import Linear, zeros_param
from models.metadata import AttentionMetadata
from pallas_kernels import allocate_state_pools, causal_conv1d, gated_delta_rule


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

    def _split_projections(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """`(qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv])` from the per-key-head layout."""
        t, hk, dk, dv = x.shape[0], self.num_key_heads, self.key_dim, self.value_dim
        per_key = self.num_value_heads // hk
        qkvz = self.in_proj_qkvz(x).reshape(t, hk, 2 * dk + 2 * per_key * dv)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + per_key * dv], axis=-1)
        ba = self.in_proj_ba(x).reshape(t, hk, 2 * per_key)
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
        if md.mesh is not None:
            raise ValueError("Gated DeltaNet layers do not run on a tensor-parallel mesh yet")
        conv_state, state = cache
        t, keys = x.shape[0], self.num_key_heads * self.key_dim
        qkv, z, b, a = self._split_projections(x)
        slots = md.page_indices[:, 0]
        q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
        has_state = md.kv_lens - q_lens > 0
        batch = (slots, has_state, md.cu_q_lens, md.num_seqs)
        weight = self.conv1d.weight[...][:, 0, :].T  # [W, channels]
        qkv, conv_state = causal_conv1d(qkv, weight, conv_state, *batch, backend=md.backend)
        q = qkv[:, :keys].reshape(t, self.num_key_heads, self.key_dim)
        k = qkv[:, keys : 2 * keys].reshape(t, self.num_key_heads, self.key_dim)
        v = qkv[:, 2 * keys :].reshape(t, self.num_value_heads, self.value_dim)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        dt = a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(dt)
        o, state = gated_delta_rule(q, k, v, g, beta, state, *batch, backend=md.backend)
        o = self.norm(o.astype(x.dtype), z)  # [T, Hv, Dv]
        return self.out_proj(o.reshape(t, -1)), (conv_state, state)


class SplitProjectionGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet: the same layer with four projections, `in_proj_qkv` (already in
    the conv's `[q | k | v]` order), `in_proj_z`, `in_proj_b` and `in_proj_a`."""

    def __init__(self, hidden_size: int, *, dtype: jnp.dtype, **shapes: int | float):
        super().__init__(hidden_size, dtype=dtype, **shapes)
        del self.in_proj_qkvz, self.in_proj_ba
        heads = self.num_value_heads
        self.in_proj_qkv = Linear(hidden_size, self.conv_dim, bias=False, dtype=dtype)
        self.in_proj_z = Linear(hidden_size, heads * self.value_dim, bias=False, dtype=dtype)
        self.in_proj_b = Linear(hidden_size, heads, bias=False, dtype=dtype)
        self.in_proj_a = Linear(hidden_size, heads, bias=False, dtype=dtype)

    def _split_projections(self, x: jax.Array) -> tuple[jax.Array, ...]:
        z = self.in_proj_z(x).reshape(x.shape[0], self.num_value_heads, self.value_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
