# SPDX-License-Identifier: Apache-2.0
"""KV cache layout of the Pallas GPU (Triton) backend, and its KV write.

Layout (a layer's; several layers stack along the page axis: api.py): `[2, K, num_pages, S, Dp]`,
with Dp = D rounded up to a power of two (at least 16). `[0, h, p]` holds the K rows of kv head h
in page p, `[1, h, p]` its V rows, each an `[S, Dp]` slab. Lanes D..Dp-1 stay zero.

Why this layout:
* A program of the kernel works on one kv head, so one head's page must be one contiguous
  `S * Dp` chunk: the gathered `[pages, S, Dp]` tile is then read with fully coalesced 128-byte
  transactions (a `[.., S, K, D]` layout would stride every row by K * D).
* Triton tiles must have power-of-two shapes, so the head dim is padded to one (64 and 128 need
  nothing; 80 or 96 become 128). The page size must be a power of two for the same reason.
* K and V of a head sit at the same offset in the two halves, so the kernel addresses both
  with one page index; there is no TPU-style interleaving, because on GPUs the loads are issued
  per tile by the kernel rather than as one DMA per page.

Axis letters: T tokens, K kv heads, S page size, D head dim, Dp padded head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.checks import check_positive
from pallas_kernels.reference import saturating_cast

MIN_HEAD_DIM = 16  # tl.dot needs every dimension >= 16


def padded_head_dim(head_dim: int) -> int:
    """`head_dim` rounded up to a power of two, at least 16."""
    return max(MIN_HEAD_DIM, 1 << (head_dim - 1).bit_length())


def allocate_kv_cache(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: jnp.dtype
) -> jax.Array:
    """A zeroed cache `[2, K, num_pages, S, Dp]`: one layer's pages, or several layers' (api.py)."""
    check_positive(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if page_size & (page_size - 1):
        raise ValueError(f"page_size {page_size} must be a power of two for Triton tiles")
    return jnp.zeros((2, num_kv_heads, num_pages, page_size, padded_head_dim(head_dim)), dtype)


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Writes k, v `[T, K, D]` at `slot_mapping[T]` (page * S + offset) into `[2, K, num_pages, S, Dp]`.

    Negative slots are padding and write nothing. One XLA scatter: in place when the caller's
    jit donates `kv_cache`.
    """
    if kv_cache.ndim != 5 or k.ndim != 3 or k.shape != v.shape:
        raise ValueError(
            f"write_kv wants kv_cache [2, K, num_pages, S, Dp] and k, v [T, K, D]; got kv_cache "
            f"{kv_cache.shape}, k {k.shape}, v {v.shape}"
        )
    _, num_kv_heads, num_pages, page_size, lanes = kv_cache.shape
    num_tokens, k_heads, head_dim = k.shape
    if kv_cache.shape[0] != 2 or k_heads != num_kv_heads or lanes != padded_head_dim(head_dim):
        raise ValueError(
            f"kv_cache {kv_cache.shape} does not hold k/v {k.shape}: expected "
            f"[2, {k_heads}, num_pages, S, {padded_head_dim(head_dim)}]"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} must be [T] = ({num_tokens},)")
    kv = saturating_cast(jnp.stack([k, v]).transpose(0, 2, 1, 3), kv_cache.dtype)  # [2, K, T, D]
    kv = jnp.pad(kv, ((0, 0), (0, 0), (0, 0), (0, lanes - head_dim)))  # [2, K, T, Dp]
    slot_mapping = slot_mapping.astype(jnp.int32)
    page = jnp.where(slot_mapping >= 0, slot_mapping // page_size, num_pages)  # out of range: dropped
    offset = slot_mapping % page_size
    return kv_cache.at[:, :, page, offset, :].set(kv, mode="drop", unique_indices=True)
