# SPDX-License-Identifier: Apache-2.0
"""RoPE and the KV-cache write of one layer in one native call (`rope_kv.cc`).

The contract is `pallas_kernels.rope.split_and_rotate` followed by `layout.write_kv` of its k
and v; the rotated q is returned. On XLA:CPU those ops run as a handful of loop fusions a layer
(the projection's convert, one rotation each for q and k with the table gather fused into them,
the cache scatter), the largest XLA work left around the native kernels in a decode step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.build import ROPE_KV_TARGET, require_loaded
from pallas_kernels.cpu.layout import CACHE_FORMATS
from pallas_kernels.reference import value_dtype

ACTIVATION_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def rope_write_kv(
    qkv: jax.Array,
    positions: jax.Array,
    table: jax.Array,
    kv_cache: jax.Array,
    slot_mapping: jax.Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    dtype: jnp.dtype,
    kv_dtype: str | None = None,
    slot_offset: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """q `[T, H, D]` of `dtype` rotated, and the cache with k (rotated) and v written at
    `slot_mapping + slot_offset` (negative slots write nothing). `qkv [T, (H + 2K) * D]`: float32,
    or bfloat16 when `dtype` is; `table [P, D]` float32 (cosines, then sines). In place when the
    caller's jit donates the cache."""
    require_loaded(", or use the attention backend 'xla'")
    dtype = jnp.dtype(dtype)
    if dtype not in ACTIVATION_DTYPES or qkv.dtype not in (jnp.dtype(jnp.float32), dtype):
        raise ValueError(
            f"rope_write_kv takes float32 or bfloat16 activations from float32 or same-dtype qkv, "
            f"not {dtype.name} from {qkv.dtype.name}"
        )
    values = value_dtype(kv_cache.dtype, kv_dtype)
    if values.name not in CACHE_FORMATS:
        raise ValueError(f"cpu_native caches hold float32, bfloat16 or float8 (e4m3fn, e5m2), not {values}")
    head_dim = table.shape[1]
    if qkv.ndim != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} is not [T, (num_heads + 2 * num_kv_heads) * head_dim] for "
            f"{num_heads} + 2 * {num_kv_heads} heads of {head_dim} (the table's width)"
        )
    q_shape = jax.ShapeDtypeStruct((qkv.shape[0], num_heads, head_dim), dtype)
    call = jax.ffi.ffi_call(
        ROPE_KV_TARGET,
        (q_shape, jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype)),
        input_output_aliases={3: 1},
    )
    return call(
        qkv,
        positions.astype(jnp.int32),
        table.astype(jnp.float32),
        kv_cache,
        slot_mapping.astype(jnp.int32),
        num_kv_heads=np.int32(num_kv_heads),
        slot_offset=np.int64(slot_offset),
        cache_format=np.int32(CACHE_FORMATS[values.name]),
    )
