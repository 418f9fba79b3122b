# SPDX-License-Identifier: Apache-2.0
"""The public paged-attention API: one entry per op, dispatched to a backend.

Each backend owns its KV cache layout (documented in its own module); nothing outside this
package depends on it. Backends: `xla` (reference.py, the oracle and CPU fallback), `pallas_tpu`
(tpu/), `pallas_gpu` (gpu/), `cpu_native` (cpu/: the reference's cache, C++ attention).
`backend="auto"` picks by JAX's default device kind.

A cache array may hold several layers' caches one after another along its page axis: allocate it
for `num_layers * num_pages` pages and give each layer's ops `first_page` (layer i's: `i *
num_pages`); its slots and block table then count from there. A model step then takes one donated
cache argument instead of one a layer, which is what its host-side call costs (on XLA:CPU each
donated argument adds a fixed cost to every call: a donation hold, an aliased output, a new array).

KV cache dtypes: float32, bfloat16, and float8 (`float8_e4m3fn`, `float8_e5m2`: half the bytes of
bfloat16, stored unscaled). The `xla` and `cpu_native` caches keep bfloat16 and float8 as bit
patterns (`reference.storage_dtype`); a float8 one is `uint8` and its ops take `kv_dtype`.
"""

from __future__ import annotations

from types import ModuleType

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pallas_kernels import reference
from pallas_kernels.backend import CPU_NATIVE, PALLAS_GPU, PALLAS_TPU, XLA, resolve_backend
from pallas_kernels.rope import split_and_rotate


def _kernel_module(backend: str) -> ModuleType:
    if backend == PALLAS_TPU:
        from pallas_kernels import tpu

        return tpu
    if backend == PALLAS_GPU:
        from pallas_kernels import gpu

        return gpu
    if backend == CPU_NATIVE:
        from pallas_kernels import cpu

        return cpu
    raise ValueError(f"{backend!r} is not a kernel backend")


def _check_own_dtype(kv_cache: jax.Array, kv_dtype: str | None) -> None:
    """The Pallas backends' caches hold values of their own dtype: `kv_dtype`, if given, is it."""
    if kv_dtype is not None and jnp.dtype(kv_dtype) != kv_cache.dtype:
        raise ValueError(f"kv_dtype {jnp.dtype(kv_dtype).name} does not match the {kv_cache.dtype} cache")


# Each layout's (page axis, page size from the cache and the head dim): see the layout modules.
_PAGES = {
    XLA: (1, lambda cache, head_dim: cache.shape[2] // head_dim),  # [2K, pages, S * D]
    CPU_NATIVE: (0, lambda cache, head_dim: cache.shape[2] // head_dim),  # [pages, 2K, S * D]
    PALLAS_TPU: (0, lambda cache, head_dim: cache.shape[2]),  # [pages, 2K, S, Dp]
    PALLAS_GPU: (2, lambda cache, head_dim: cache.shape[3]),  # [2, K, pages, S, Dp]
}
# Slot numbers (page * page_size + offset) are int32: a cache array holds fewer slots than this.
SLOT_LIMIT = 2**31


def _check_first_page(first_page: int) -> None:
    if first_page < 0:
        raise ValueError(f"first_page must be >= 0, got {first_page}")


def _shift_slots(
    slot_mapping: jax.Array, kv_cache: jax.Array, head_dim: int, first_page: int, backend: str
) -> jax.Array:
    """`slot_mapping` counted from page `first_page` of the cache; negative slots stay padding."""
    _check_first_page(first_page)
    if first_page == 0:
        return slot_mapping
    page_axis, page_size_of = _PAGES[backend]
    page_size = page_size_of(kv_cache, head_dim)
    if kv_cache.shape[page_axis] * page_size >= SLOT_LIMIT:
        raise ValueError(
            f"a cache of {kv_cache.shape[page_axis]} pages of {page_size} tokens has more slots than "
            "int32 slot numbers address: give the layers several cache arrays"
        )
    return jnp.where(slot_mapping >= 0, slot_mapping + first_page * page_size, slot_mapping)


def _shift_pages(page_indices: jax.Array, first_page: int) -> jax.Array:
    _check_first_page(first_page)
    return page_indices + first_page if first_page else page_indices


# Each layout's axis of KV-head rows (see the layout modules), which a sharded cache splits.
_HEAD_AXIS = {XLA: 0, CPU_NATIVE: 1, PALLAS_TPU: 1, PALLAS_GPU: 1}


def kv_cache_partition_spec(backend: str, axis_name: str) -> PartitionSpec:
    """How a cache in `backend`'s layout splits over mesh axis `axis_name`: on its KV heads.

    A cache allocated for `N * Hkv` heads and split this way over N devices is, on each device,
    that device's own cache for its `Hkv` heads in the same layout (in the `xla` and
    `cpu_native` layouts, whose K rows precede the V rows, the global array is the N local
    caches side by side, not one cache of `N * Hkv` heads). Every op then runs per device, on
    the local cache (under `jax.shard_map`), with the local head counts.
    """
    backend = resolve_backend(backend, interpret=True)
    spec = [None] * (_HEAD_AXIS[backend] + 1)
    spec[_HEAD_AXIS[backend]] = axis_name
    return PartitionSpec(*spec)


def allocate_kv_cache(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype,
    *,
    backend: str = "auto",
) -> jax.Array:
    """A zeroed KV cache of `num_pages` pages in `backend`'s layout, for values of `dtype`: one
    layer's, or several layers' one after another (see `first_page`)."""
    backend = resolve_backend(backend, interpret=True)
    if backend == XLA:
        return reference.allocate_kv_cache_reference(num_pages, page_size, num_kv_heads, head_dim, dtype)
    return _kernel_module(backend).allocate_kv_cache(num_pages, page_size, num_kv_heads, head_dim, dtype)


def write_kv(
    kv_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    backend: str = "auto",
    kv_dtype: str | None = None,
    first_page: int = 0,
    interpret: bool = False,
) -> jax.Array:
    """Writes k, v `[T, Hkv, D]` at `slot_mapping[T]` (page * page_size + offset).

    Negative slots are padding and write nothing. Donate `kv_cache` to update it in place.
    `kv_dtype` names the cached values' dtype (the one the cache was allocated for); a float8
    cache of the `xla` and `cpu_native` backends needs it. `first_page`: where this layer's
    pages start in a cache that holds several (the module's docstring). `interpret` runs the
    `pallas_tpu` backend's write kernels on CPU (tests), as in `ragged_paged_attention`; the
    other backends write with XLA (`pallas_gpu`: a scatter, which XLA:GPU keeps in place).
    """
    backend = resolve_backend(backend, interpret=True)
    slot_mapping = _shift_slots(slot_mapping, kv_cache, k.shape[-1], first_page, backend)
    if backend in (XLA, CPU_NATIVE):
        write = reference.write_kv_reference if backend == XLA else _kernel_module(backend).write_kv
        return write(kv_cache, k, v, slot_mapping, kv_dtype=kv_dtype)
    _check_own_dtype(kv_cache, kv_dtype)
    if backend == PALLAS_TPU:
        return _kernel_module(backend).write_kv(kv_cache, k, v, slot_mapping, interpret=interpret)
    return _kernel_module(backend).write_kv(kv_cache, k, v, slot_mapping)


def rope_write_kv(
    qkv: jax.Array,
    positions: jax.Array,
    rope_table: jax.Array,
    kv_cache: jax.Array,
    slot_mapping: jax.Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    dtype: jnp.dtype,
    backend: str = "auto",
    kv_dtype: str | None = None,
    first_page: int = 0,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """RoPE on a fused projection and the KV write: q `[T, H, D]` rotated, and the cache.

    `qkv [T, (H + 2K) * D]` holds a step's q, k and v heads side by side (float32 products, or
    values of `dtype`); q and k rotate by the rows of `rope_table [P, D]` (float32 cosines, then
    sines) at `positions[T]`, and k, v are written as `write_kv` does (`slot_mapping`,
    `kv_dtype`, `first_page`, `interpret` as there). Values are rounded to `dtype` after the projection and
    after the rotation (`rope.split_and_rotate`). The `cpu_native` backend does it all in one
    native call; the others run `split_and_rotate` and their `write_kv`.
    """
    backend = resolve_backend(backend, interpret=True)
    if backend == CPU_NATIVE and jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        _check_first_page(first_page)
        page_size = _PAGES[CPU_NATIVE][1](kv_cache, rope_table.shape[1])
        return _kernel_module(backend).rope_write_kv(
            qkv, positions, rope_table, kv_cache, slot_mapping,
            num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype, kv_dtype=kv_dtype,
            slot_offset=first_page * page_size,
        )  # fmt: skip
    q, k, v = split_and_rotate(
        qkv, positions, rope_table, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype
    )
    kv_cache = write_kv(
        kv_cache, k, v, slot_mapping, backend=backend, kv_dtype=kv_dtype, first_page=first_page,
        interpret=interpret,
    )  # fmt: skip
    return q, kv_cache


def ragged_paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str = "auto",
    interpret: bool = False,
    kv_dtype: str | None = None,
    first_page: int = 0,
    sinks: jax.Array | None = None,
    attention_chunk_size: int | None = None,
    **tuning: int,
) -> jax.Array:
    """Causal attention of ragged query rows `q[T, Hq, D]` over their sequences' paged KV.

    Sequence i owns query rows `cu_q_lens[i]:cu_q_lens[i+1]`, its last tokens, and
    `kv_lens[i]` cached tokens (already written) in pages `page_indices[i]`. Rows past
    `cu_q_lens[num_seqs]` are padding. `kv_dtype` and `first_page` as in `write_kv`. `sinks`
    `[Hq]` float32: a learned logit per query head in every row's softmax denominator (GPT-OSS's
    attention sinks; `reference.ragged_paged_attention_reference`). `attention_chunk_size`:
    chunked local attention (Llama 4), a query at position p sees only the keys of its own chunk
    of that many positions, from `(p // attention_chunk_size) * attention_chunk_size`. Tuning
    keywords go to the Pallas backends.
    """
    backend = resolve_backend(backend, interpret=interpret)
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [{q.shape[1]}] (one per query head), got {sinks.shape}")
    if attention_chunk_size is not None and attention_chunk_size <= 0:
        raise ValueError(f"attention_chunk_size must be positive, got {attention_chunk_size}")
    page_indices = _shift_pages(page_indices, first_page)
    if backend in (XLA, CPU_NATIVE):
        if tuning:
            raise ValueError(f"the {backend} backend takes no tuning arguments, got {sorted(tuning)}")
        attend = (
            reference.ragged_paged_attention_reference
            if backend == XLA
            else _kernel_module(backend).ragged_paged_attention
        )
        return attend(
            q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, kv_dtype=kv_dtype,
            sinks=sinks, attention_chunk_size=attention_chunk_size,
        )  # fmt: skip
    _check_own_dtype(kv_cache, kv_dtype)
    return _kernel_module(backend).ragged_paged_attention(
        q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
        attention_chunk_size=attention_chunk_size, interpret=interpret, **tuning,
    )  # fmt: skip
