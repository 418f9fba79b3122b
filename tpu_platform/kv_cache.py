# SPDX-License-Identifier: Apache-2.0
"""KV cache budget and allocation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from models.config import ModelConfig
from models.sharding import MODEL_AXIS
from pallas_kernels import (
    SLOT_LIMIT,
    allocate_kv_cache,
    allocate_latent_cache,
    kv_cache_partition_spec,
    latent_cache_partition_spec,
    latent_page_bytes,
)

GIB = 1 << 30
# What a KV cache may hold, by dtype name.
KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def kv_cache_dtype(name: str) -> jnp.dtype:
    """The KV cache's value dtype named `name`, or a ValueError listing the choices."""
    if str(name) not in KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return jnp.dtype(name)


def available_kv_bytes(
    device: jax.Device,
    *,
    memory_utilization: float,
    cpu_kv_cache_gb: float,
    explicit_bytes: int | None = None,
) -> int:
    """Bytes the KV cache may take on `device` (on a tensor-parallel mesh: on each of its
    devices, which hold equal shares of the cache).

    `explicit_bytes` (vLLM's `kv_cache_memory_bytes`), when given, comes first on every device;
    on TPU/GPU it must fit in the device's memory limit minus what is already in use.
    CPU: else `cpu_kv_cache_gb` (host RAM is shared with everything else, so it is an explicit
    budget). TPU/GPU: else `memory_utilization` of the device's memory limit, minus what is
    already in use (the weights are loaded by then).
    """
    if explicit_bytes is not None and explicit_bytes <= 0:
        raise ValueError(f"kv_cache_memory_bytes must be positive, got {explicit_bytes}")
    if device.platform == "cpu":
        return int(explicit_bytes) if explicit_bytes is not None else int(cpu_kv_cache_gb * GIB)
    limit, in_use = _device_memory(device)
    if explicit_bytes is not None:
        if explicit_bytes > limit - in_use:
            raise ValueError(
                f"kv_cache_memory_bytes={explicit_bytes} does not fit on {device.device_kind}: limit "
                f"{limit} B, {in_use} B in use; lower --kv-cache-memory-bytes"
            )
        return int(explicit_bytes)
    free = int(limit * memory_utilization) - in_use
    if free <= 0:
        raise RuntimeError(
            f"no device memory left for the KV cache on {device.device_kind}: limit {limit} B, "
            f"in use {in_use} B; raise gpu_memory_utilization or use a smaller model"
        )
    return free


def _device_memory(device: jax.Device) -> tuple[int, int]:
    """The device's memory limit and the bytes in use on it."""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise RuntimeError(f"{device.device_kind} reports no memory limit; cannot size the KV cache")
    return int(limit), int(stats.get("bytes_in_use", 0))


def pages_for_sequences(num_seqs: int, max_model_len: int, page_size: int) -> int:
    """KV pages that hold `num_seqs` sequences of `max_model_len` tokens at once, plus the one
    page vLLM's block pool keeps back (its null block)."""
    return num_seqs * -(-max_model_len // page_size) + 1


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes a token's keys and values take over all layers (the CPU layout adds no padding)."""
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


def model_kv_bytes_per_token(config: ModelConfig, itemsize: int) -> int:
    """Bytes a token's cache entries take over all layers: per-head keys and values, or one
    latent row a layer for multi-head latent attention (`ModelConfig.latent_cache_width`)."""
    if config.latent_cache_width:
        return config.num_layers * config.latent_cache_width * itemsize
    return kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, itemsize)


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
    mesh: Mesh | None = None,
    *,
    latent_width: int = 0,
) -> list[jax.Array]:
    """Zeroed arrays in `backend`'s layout holding `num_caches` caches of `num_pages` pages,
    `caches_per_array` of them one after another along each array's page axis (cache c from
    page `(c % per_array) * num_pages` of array `c // per_array`: `pallas_kernels.api`). A step's
    program then takes and donates one cache argument (or a few), not one a layer.

    Every backend stacks. On CPU it is what makes a step's call cheap (fewer donated
    arguments). On TPU and GPU it costs nothing once every op on the cache keeps its layout (the
    compiled steps hold no copy of either arrangement: tests/aot/test_step_kv_copies.py), and
    one array per layer compiled to no smaller program.

    On a tensor-parallel `mesh`, `num_kv_heads` are all the heads and each array is made on the
    devices already split on them (`pallas_kernels.kv_cache_partition_spec`): each device
    allocates only its own heads' pages; the pages are per device.

    `latent_width > 0` allocates latent caches instead (multi-head latent attention: one shared
    row of that many values a token, `pallas_kernels.allocate_latent_cache`; the head arguments
    are unused), whole on every device of a `mesh` (`pallas_kernels.latent_cache_partition_spec`)."""
    per_array = caches_per_array(num_caches, num_pages, page_size)

    def one_array(pages: int) -> jax.Array:
        if latent_width:
            return allocate_latent_cache(pages, page_size, latent_width, dtype, backend=backend)
        return allocate_kv_cache(pages, page_size, num_kv_heads, head_dim, dtype, backend=backend)

    def allocate() -> list[jax.Array]:
        return [
            one_array(min(per_array, num_caches - first) * num_pages)
            for first in range(0, num_caches, per_array)
        ]

    if mesh is None:
        return allocate()
    spec = latent_cache_partition_spec() if latent_width else kv_cache_partition_spec(backend, MODEL_AXIS)
    return jax.jit(allocate, out_shardings=NamedSharding(mesh, spec))()


def page_bytes_per_device(
    model_config: ModelConfig, page_size: int, heads_per_device: int, dtype: jnp.dtype, backend: str
) -> int:
    """Bytes one page of one layer takes on one device in the attention backend's own cache
    layout (its share of the KV heads: pages are counted per device; a latent cache's page
    whole)."""
    if model_config.latent_cache_width:
        return latent_page_bytes(page_size, model_config.latent_cache_width, dtype, backend=backend)
    head_dim = model_config.head_dim
    two_pages = jax.eval_shape(
        lambda: allocate_kv_cache(2, page_size, heads_per_device, head_dim, dtype, backend=backend)
    )
    return two_pages.size * two_pages.dtype.itemsize // 2
