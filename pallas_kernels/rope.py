# SPDX-License-Identifier: Apache-2.0
"""RoPE on a fused q/k/v projection in pure jnp: the reference of `api.rope_write_kv`.

A RoPE table holds each position's cosines and then its sines (`[P, D]`, float32). The rotation
uses the rotate-half convention (as HF and vLLM do). Values are rounded to the step's activation
dtype after the projection and after the rotation: that is where the unfused model rounds them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rotate_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates `x[T, heads, D]` by the angles whose `cos`, `sin` (`[T, D/2]`) are given, in
    float32; the result keeps `x`'s dtype."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def table_rows(table: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The cosines and sines `[T, D/2]` of `positions[T]` from a RoPE table (positions past its
    end take its last row)."""
    rows = jnp.take(table, positions, axis=0, mode="clip")  # [T, D]
    half = table.shape[1] // 2
    return rows[:, :half], rows[:, half:]


def split_and_rotate(
    qkv: jax.Array,
    positions: jax.Array,
    table: jax.Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    dtype: jnp.dtype,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q `[T, H, D]` and k `[T, K, D]` rotated, and v `[T, K, D]`, of `dtype`, from the projection
    `qkv[T, (H + 2K) * D]` (its float32 products, or values of `dtype`)."""
    q, k, v = split_heads(
        qkv, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=table.shape[1], dtype=dtype
    )
    cos, sin = table_rows(table, positions)
    return rotate_half(q, cos, sin), rotate_half(k, cos, sin), v


def split_heads(
    qkv: jax.Array, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q `[T, H, D]`, k and v `[T, K, D]` of `dtype` from a projection `qkv[T, (H + 2K) * D]`."""
    t = qkv.shape[0]
    y = qkv.astype(dtype)
    q_end = num_heads * head_dim
    k_end = q_end + num_kv_heads * head_dim
    q = y[:, :q_end].reshape(t, num_heads, head_dim)
    k = y[:, q_end:k_end].reshape(t, num_kv_heads, head_dim)
    return q, k, y[:, k_end:].reshape(t, num_kv_heads, head_dim)
