# SPDX-License-Identifier: Apache-2.0
"""KV cache layout of the `cpu_native` backend: `[num_pages, 2 * Hkv, page_size * D]`.

A page holds every kv head's keys (rows `0..Hkv-1`) and then their values (rows
`Hkv..2*Hkv-1`), each `page_size * D` contiguous values, so all of a page is one block of memory
(all heads' K and V of a page). Pages are scattered by the block table, and on the CPUs
measured scattered reads of whole pages run markedly faster than of one head's part of a page
(the reference's `[2 * Hkv, pages, S * D]` puts each head's page elsewhere), so a decode row's
attention, which reads all heads of each of its pages, streams its cache in those blocks. As in
the reference, bfloat16 and float8 are stored as bit patterns (`uint16`, `uint8`) and the write
is one windowed scatter, with the page axis first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import scatter_kv, storage_dtype

# The values a cache holds, as the native kernels' `cache_format` attribute says them.
CACHE_FORMATS = {"float32": 0, "bfloat16": 1, "float8_e4m3fn": 2, "float8_e5m2": 3}


def allocate_kv_cache(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: jnp.dtype
) -> jax.Array:
    """A zeroed `[num_pages, 2 * Hkv, page_size * D]`: one layer's pages, or several layers' (api.py)."""
    return jnp.zeros((num_pages, 2 * num_kv_heads, page_size * head_dim), storage_dtype(dtype))


def write_kv(
    kv_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    kv_dtype: str | None = None,
) -> jax.Array:
    """Writes k, v `[T, Hkv, D]` at `slot_mapping[T]` (page * S + offset); negative slots write
    nothing. In place when the caller's jit donates the cache. `kv_dtype` as in the reference."""
    return scatter_kv(kv_cache, k, v, slot_mapping, page_axis=0, kv_dtype=kv_dtype)
