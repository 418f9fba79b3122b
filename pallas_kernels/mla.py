# SPDX-License-Identifier: Apache-2.0
"""The public paged multi-head latent attention (MLA) API: the latent cache, its write and the
attention over it, with the ragged semantics of `ragged_paged_attention` (prefill chunks and
decodes mixed, page tables, `cu_q_lens`, `kv_lens`, `num_seqs`).

The cache layout and the absorbed form are described in `mla_reference.py`. Every backend
(`xla`, `cpu_native`, `pallas_tpu`, `pallas_gpu`) runs the pure-jnp reference for now, which XLA
compiles for every device; the backend name is still checked, so that a Pallas kernel can take
over one backend without changing callers.

A cache array may hold several layers' caches one after another along its page axis (`first_page`,
as in api.py). Under tensor parallelism the latent cache is replicated (`latent_cache_partition_
spec`): its one shared row per token has no head axis to split, each device's query heads read
all of it, and splitting it on the row would make every score a cross-device sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pallas_kernels.backend import resolve_backend
from pallas_kernels.mla_reference import (
    allocate_latent_cache_reference,
    mla_paged_attention_reference,
    write_latent_reference,
)
from pallas_kernels.reference import storage_dtype


def latent_cache_partition_spec() -> PartitionSpec:
    """How a latent cache lies on a tensor-parallel mesh: whole on every device."""
    return PartitionSpec()


def latent_page_bytes(page_size: int, width: int, dtype: jnp.dtype) -> int:
    """Bytes one page of one layer's latent cache takes: `page_size * width` values of `dtype`."""
    return page_size * width * jnp.dtype(storage_dtype(dtype)).itemsize


def allocate_latent_cache(
    num_pages: int, page_size: int, width: int, dtype: jnp.dtype, *, backend: str = "auto"
) -> jax.Array:
    """A zeroed latent cache of `num_pages` pages of `page_size` rows of `width` (`kv_lora_rank +
    qk_rope_head_dim`) values of `dtype`: one layer's, or several layers' one after another."""
    resolve_backend(backend, interpret=True)
    return allocate_latent_cache_reference(num_pages, page_size, width, dtype)


def _shift(slot_mapping: jax.Array, page_size: int, first_page: int) -> jax.Array:
    if first_page < 0:
        raise ValueError(f"first_page must be >= 0, got {first_page}")
    if first_page == 0:
        return slot_mapping
    return jnp.where(slot_mapping >= 0, slot_mapping + first_page * page_size, slot_mapping)


def write_latent(
    cache: jax.Array,
    latent: jax.Array,
    k_rope: jax.Array,
    slot_mapping: jax.Array,
    *,
    backend: str = "auto",
    kv_dtype: str | None = None,
    first_page: int = 0,
) -> jax.Array:
    """Writes each token's row `[latent | k_rope]` (`[T, L]`, `[T, R]`, RoPE already applied to
    `k_rope`) at `slot_mapping[T]` (page * page_size + offset); negative slots are padding and
    write nothing. Donate `cache` to update it in place. `kv_dtype`: the cached values' dtype
    (needed for a float8 cache); `first_page`: where this layer's pages start in the array."""
    resolve_backend(backend, interpret=True)
    page_size = cache.shape[1] // (latent.shape[1] + k_rope.shape[1])
    slot_mapping = _shift(slot_mapping, page_size, first_page)
    return write_latent_reference(cache, latent, k_rope, slot_mapping, kv_dtype=kv_dtype)


def mla_paged_attention(
    q: jax.Array,
    cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    latent_dim: int,
    backend: str = "auto",
    kv_dtype: str | None = None,
    first_page: int = 0,
) -> jax.Array:
    """Causal latent attention of ragged absorbed queries `q[T, H, L + R]` over their sequences'
    latent rows; returns `[T, H, L]` (each head's weighted latents, before its `W_UV`).

    Sequence i owns query rows `cu_q_lens[i]:cu_q_lens[i+1]`, its last tokens, and `kv_lens[i]`
    cached tokens (already written) in pages `page_indices[i]`; rows past
    `cu_q_lens[num_seqs]` are padding (zeros). `kv_dtype` and `first_page` as in `write_latent`.
    """
    resolve_backend(backend, interpret=True)
    if first_page < 0:
        raise ValueError(f"first_page must be >= 0, got {first_page}")
    if q.shape[-1] <= latent_dim:
        raise ValueError(
            f"query rows of width {q.shape[-1]} leave no rope part after a latent of {latent_dim}"
        )
    page_indices = page_indices + first_page if first_page else page_indices
    return mla_paged_attention_reference(
        q, cache, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, latent_dim=latent_dim, kv_dtype=kv_dtype,
    )  # fmt: skip
