# SPDX-License-Identifier: Apache-2.0
"""The public paged multi-head latent attention (MLA) API: the latent cache, its write and the
attention over it, with the ragged semantics of `ragged_paged_attention` (prefill chunks and
decodes mixed, page tables, `cu_q_lens`, `kv_lens`, `num_seqs`).

The absorbed form is described in `mla_reference.py`. Each backend owns its cache layout:
`xla` and `cpu_native` run the pure-jnp reference on its layout (`[pages, S * C]`, values stored
as bits); `pallas_tpu` runs the Mosaic kernel on `[pages, S, Cp]` (`tpu/mla_kernel.py`: rows
padded to 128 lanes), `pallas_gpu` the Triton kernel on `[pages, S, Lg + Rg]`
(`gpu/mla_kernel.py`: latent and rope parts each a power of two wide; DeepSeek's 512 + 64 as
they are). Nothing outside this package depends on a layout.

A cache array may hold several layers' caches one after another along its page axis (`first_page`,
as in api.py). Under tensor parallelism the latent cache is replicated (`latent_cache_partition_
spec`): its one shared row per token has no head axis to split, each device's query heads read
all of it, and splitting it on the row would make every score a cross-device sum.
"""

from __future__ import annotations

from types import ModuleType

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pallas_kernels.backend import PALLAS_GPU, PALLAS_TPU, resolve_backend
from pallas_kernels.mla_reference import (
    allocate_latent_cache_reference,
    mla_paged_attention_reference,
    write_latent_reference,
)


def _kernel_module(backend: str) -> ModuleType | None:
    """The Pallas module of `backend`, or None for the reference's (`xla`, `cpu_native`)."""
    if backend == PALLAS_TPU:
        from pallas_kernels.tpu import mla_kernel

        return mla_kernel
    if backend == PALLAS_GPU:
        from pallas_kernels.gpu import mla_kernel

        return mla_kernel
    return None


def latent_cache_partition_spec() -> PartitionSpec:
    """How a latent cache lies on a tensor-parallel mesh: whole on every device."""
    return PartitionSpec()


def latent_page_bytes(page_size: int, width: int, dtype: jnp.dtype, *, backend: str = "auto") -> int:
    """Bytes one page of one layer's latent cache takes in `backend`'s layout: `page_size * width`
    values of `dtype`, plus the layout's padding (`pallas_tpu`: rows of 128 lanes)."""
    page = jax.eval_shape(lambda: allocate_latent_cache(1, page_size, width, dtype, backend=backend))
    return page.size * page.dtype.itemsize


def allocate_latent_cache(
    num_pages: int, page_size: int, width: int, dtype: jnp.dtype, *, backend: str = "auto"
) -> jax.Array:
    """A zeroed latent cache of `num_pages` pages of `page_size` rows of `width` (`kv_lora_rank +
    qk_rope_head_dim`) values of `dtype`, in `backend`'s layout: one layer's, or several layers'
    one after another."""
    kernels = _kernel_module(resolve_backend(backend, interpret=True))
    if kernels is None:
        return allocate_latent_cache_reference(num_pages, page_size, width, dtype)
    return kernels.allocate_latent_cache(num_pages, page_size, width, dtype)


def _check_first_page(first_page: int) -> None:
    if first_page < 0:
        raise ValueError(f"first_page must be >= 0, got {first_page}")


def _check_own_dtype(cache: jax.Array, kv_dtype: str | None) -> None:
    """The Pallas layouts hold values of their own dtype: `kv_dtype`, if given, is it."""
    if kv_dtype is not None and jnp.dtype(kv_dtype) != cache.dtype:
        raise ValueError(f"kv_dtype {jnp.dtype(kv_dtype).name} does not match the {cache.dtype} latent cache")


def write_latent(
    cache: jax.Array,
    latent: jax.Array,
    k_rope: jax.Array,
    slot_mapping: jax.Array,
    *,
    backend: str = "auto",
    kv_dtype: str | None = None,
    first_page: int = 0,
    interpret: bool = False,
) -> jax.Array:
    """Writes each token's row `[latent | k_rope]` (`[T, L]`, `[T, R]`, RoPE already applied to
    `k_rope`) at `slot_mapping[T]` (page * page_size + offset); negative slots are padding and
    write nothing. Donate `cache` to update it in place. `kv_dtype`: the cached values' dtype
    (needed for a float8 cache of the reference's layout); `first_page`: where this layer's pages
    start in the array. `interpret` runs the `pallas_tpu` backend's write kernels on CPU (tests);
    the other backends write with XLA."""
    _check_first_page(first_page)
    backend = resolve_backend(backend, interpret=True)
    kernels = _kernel_module(backend)
    if kernels is None:
        page_size = cache.shape[1] // (latent.shape[1] + k_rope.shape[1])
    else:
        _check_own_dtype(cache, kv_dtype)
        page_size = cache.shape[1]
    if first_page:
        slot_mapping = jnp.where(slot_mapping >= 0, slot_mapping + first_page * page_size, slot_mapping)
    if kernels is None:
        return write_latent_reference(cache, latent, k_rope, slot_mapping, kv_dtype=kv_dtype)
    if backend == PALLAS_TPU:
        return kernels.write_latent(cache, latent, k_rope, slot_mapping, interpret=interpret)
    return kernels.write_latent(cache, latent, k_rope, slot_mapping)


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
    interpret: bool = False,
    **tuning: int,
) -> jax.Array:
    """Causal latent attention of ragged absorbed queries `q[T, H, L + R]` over their sequences'
    latent rows; returns `[T, H, L]` (each head's weighted latents, before its `W_UV`).

    Sequence i owns query rows `cu_q_lens[i]:cu_q_lens[i+1]`, its last tokens, and `kv_lens[i]`
    cached tokens (already written) in pages `page_indices[i]`; rows past
    `cu_q_lens[num_seqs]` are padding (zeros). `kv_dtype` and `first_page` as in `write_latent`.
    `interpret` runs a Pallas backend's kernel on CPU (tests); tuning keywords go to it.
    """
    backend = resolve_backend(backend, interpret=interpret)
    _check_first_page(first_page)
    if q.shape[-1] <= latent_dim:
        raise ValueError(
            f"query rows of width {q.shape[-1]} leave no rope part after a latent of {latent_dim}"
        )
    page_indices = page_indices + first_page if first_page else page_indices
    kernels = _kernel_module(backend)
    if kernels is None:
        if tuning:
            raise ValueError(f"the {backend} backend takes no tuning arguments, got {sorted(tuning)}")
        return mla_paged_attention_reference(
            q, cache, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=sm_scale, latent_dim=latent_dim, kv_dtype=kv_dtype,
        )  # fmt: skip
    _check_own_dtype(cache, kv_dtype)
    return kernels.mla_paged_attention(
        q, cache, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, latent_dim=latent_dim, interpret=interpret, **tuning,
    )  # fmt: skip
