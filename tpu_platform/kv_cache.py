# SPDX-License-Identifier: Apache-2.0
"""KV cache budget and allocation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import SLOT_LIMIT, allocate_kv_cache

GIB = 1 << 30
# What a KV cache may hold, by dtype name.
KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def kv_cache_dtype(name: str) -> jnp.dtype:
    """The KV cache's value dtype named `name`, or a ValueError listing the choices."""
    if str(name) not in KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return jnp.dtype(name)


def available_kv_bytes(device: jax.Device, *, memory_utilization: float, cpu_kv_cache_gb: float) -> int:
    """Bytes the KV cache may take on `device`.

    CPU: `cpu_kv_cache_gb` (host RAM is shared with everything else, so it is an explicit budget).
    TPU/GPU: `memory_utilization` of the device's memory limit, minus what is already in use
    (the weights are loaded by then).
    """
    if device.platform == "cpu":
        return int(cpu_kv_cache_gb * GIB)
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise RuntimeError(f"{device.device_kind} reports no memory limit; cannot size the KV cache")
    free = int(limit * memory_utilization) - int(stats.get("bytes_in_use", 0))
    if free <= 0:
        raise RuntimeError(
            f"no device memory left for the KV cache on {device.device_kind}: limit {limit} B, "
            f"in use {stats.get('bytes_in_use')} B; raise gpu_memory_utilization or use a smaller model"
        )
    return free


def caches_per_array(num_caches: int, num_pages: int, page_size: int) -> int:
    """How many caches of `num_pages` pages one array holds: all of them, unless their slots
    (page * page_size + offset, int32) would pass int32's range."""
    fit = (SLOT_LIMIT - 1) // (num_pages * page_size)
    return max(1, min(num_caches, fit))


def allocate_stacked_caches(
    num_caches: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype,
    backend: str,
) -> list[jax.Array]:
    """Zeroed arrays in `backend`'s layout holding `num_caches` caches of `num_pages` pages,
    `caches_per_array` of them one after another along each array's page axis (cache c from
    page `(c % per_array) * num_pages` of array `c // per_array`: `pallas_kernels.api`). A step's
    program then takes and donates one cache argument (or a few), not one a layer."""
    per_array = caches_per_array(num_caches, num_pages, page_size)
    shape = (page_size, num_kv_heads, head_dim, dtype)
    return [
        allocate_kv_cache(min(per_array, num_caches - first) * num_pages, *shape, backend=backend)
        for first in range(0, num_caches, per_array)
    ]
