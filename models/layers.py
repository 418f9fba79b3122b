# SPDX-License-Identifier: Apache-2.0
"""Shared building blocks: every model is assembled from these.

Each weight matrix is its own parameter (one pytree leaf): XLA:CPU copies slices of stacked
weights on every step, so stacking layers would cost a full weight copy per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig, RopeScaling
from models.metadata import AttentionMetadata
from pallas_kernels import ragged_paged_attention, write_kv


def _zeros(shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


class Linear(nnx.Module):
    """`y = x @ kernel (+ bias)` with the kernel stored `[in, out]`."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype):
        self.kernel = _zeros((in_features, out_features), dtype)
        self.bias = _zeros((out_features,), dtype) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("td,df->tf", x, self.kernel[...])
        return y + self.bias[...] if self.bias is not None else y


class Embedding(nnx.Module):
    """Token embedding table `[V, D]`, also usable as a tied LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: jnp.dtype):
        self.embedding = _zeros((vocab_size, hidden_size), dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("td,vd->tv", x, self.embedding[...], preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in float32, `x * w` (or `x * (1 + w)` when offset)."""

    def __init__(self, size: int, *, eps: float, dtype: jnp.dtype, unit_offset: bool = False):
        self.weight = _zeros((size,), dtype)
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...].astype(jnp.float32)
        return (x32 * (1.0 + w if self.unit_offset else w)).astype(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """`[H / 2]` inverse frequencies, with Llama 3 scaling when configured."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv.astype(np.float32)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates `x[T, heads, H]` by `positions[T]` (rotate-half convention, as HF)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class PagedAttention(nnx.Module):
    """Grouped-query self-attention over the paged KV cache, with RoPE."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, sliding_window: int | None = None):
        d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(d, n * h, bias=bias, dtype=dtype)
        self.k_proj = Linear(d, k * h, bias=bias, dtype=dtype)
        self.v_proj = Linear(d, k * h, bias=bias, dtype=dtype)
        self.o_proj = Linear(n * h, d, bias=False, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.rope_theta, self.rope_scaling = config.rope_theta, config.rope_scaling
        self.sliding_window = sliding_window
        self.sm_scale = h**-0.5

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        t = x.shape[0]
        q = self.q_proj(x).reshape(t, self.num_heads, self.head_dim)  # [T, N, H]
        k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)  # [T, K, H]
        v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)  # [T, K, H]
        inv_freq = rope_inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        kv_cache = write_kv(kv_cache, k, v, md.slot_mapping, backend=md.backend)
        o = ragged_paged_attention(
            q, kv_cache, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=self.sm_scale, sliding_window=self.sliding_window, backend=md.backend,
        )  # fmt: skip
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim)), kv_cache


class GatedMLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool, dtype: jnp.dtype):
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
