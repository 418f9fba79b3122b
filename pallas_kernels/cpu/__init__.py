# SPDX-License-Identifier: Apache-2.0
"""Native CPU backend: a page-major KV cache (`layout.py`), attention in C++ via XLA FFI, RoPE
with the KV write in one call (`rope_kv.py`), SwiGLU's `silu(gate) * up` (`activation.py`),
RMSNorm with its residual add (`norm.py`), and dense layers (`dense.py`): bfloat16 on AMX, AVX-512
BF16 or AVX2, float32 on AVX2, int8 weights on AVX-512 or AVX2 (`dense_int8.py`), 4-bit weights
packed two a byte on AVX2 or any CPU (`dense_int4.py`).

XLA:CPU has no fast formulation of paged attention (a page gather is slow there, and so is every
pure-XLA variant tried: docs/kernels.md), so on CPU
the attention is one FFI call into `paged_attention.cc`, which walks each row's pages in place.
Call `load(build_dir)` once per process before tracing or loading programs that use it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.activation import silu_and_mul, silu_and_mul_reference
from pallas_kernels.cpu.build import (
    ATTENTION_TARGET,
    NativeKernelError,
    dense_f32_usable,
    dense_int4_isas,
    dense_int8_isas,
    dense_isa,
    dense_isas,
    is_loaded,
    load,
    require_loaded,
)
from pallas_kernels.cpu.dense import (
    can_pack,
    can_pack_f32,
    native_dense,
    native_dense_reference,
    pack_dense_kernel,
    pack_dense_kernel_f32,
)
from pallas_kernels.cpu.dense_int4 import DEPTH_MULTIPLE as INT4_DEPTH_MULTIPLE
from pallas_kernels.cpu.dense_int4 import (
    can_pack_int4,
    dense_int4_takes_groups,
    float16_scales,
    native_dense_int4,
    native_dense_int4_reference,
    pack_dense_kernel_int4,
)
from pallas_kernels.cpu.dense_int8 import (
    can_pack_int8,
    dense_int8_takes_groups,
    float16_int8_scales,
    native_dense_int8,
    native_dense_int8_fixed_point_reference,
    native_dense_int8_reference,
    pack_dense_kernel_int8,
)
from pallas_kernels.cpu.layout import CACHE_FORMATS, allocate_kv_cache, write_kv
from pallas_kernels.cpu.norm import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from pallas_kernels.cpu.norm import takes as norm_takes
from pallas_kernels.cpu.rope_kv import rope_write_kv
from pallas_kernels.reference import value_dtype

__all__ = [
    "INT4_DEPTH_MULTIPLE",
    "NativeKernelError",
    "add_rms_norm",
    "add_rms_norm_reference",
    "allocate_kv_cache",
    "can_pack",
    "can_pack_f32",
    "can_pack_int4",
    "can_pack_int8",
    "dense_f32_usable",
    "dense_int4_isas",
    "dense_int4_takes_groups",
    "dense_int8_isas",
    "dense_int8_takes_groups",
    "dense_isa",
    "dense_isas",
    "float16_int8_scales",
    "float16_scales",
    "is_loaded",
    "load",
    "native_dense",
    "native_dense_int4",
    "native_dense_int4_reference",
    "native_dense_int8",
    "native_dense_int8_fixed_point_reference",
    "native_dense_int8_reference",
    "native_dense_reference",
    "norm_takes",
    "pack_dense_kernel",
    "pack_dense_kernel_f32",
    "pack_dense_kernel_int4",
    "pack_dense_kernel_int8",
    "ragged_paged_attention",
    "rms_norm",
    "rms_norm_reference",
    "rope_write_kv",
    "silu_and_mul",
    "silu_and_mul_reference",
    "write_kv",
]


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
    kv_dtype: str | None = None,
    sinks: jax.Array | None = None,
    attention_chunk_size: int | None = None,
) -> jax.Array:
    """Same contract as `reference.ragged_paged_attention_reference` (float32 inside; bfloat16
    queries are read and the output written as bfloat16, other dtypes pass through float32;
    `sinks [H]` float32, optional; `attention_chunk_size`: chunked local attention)."""
    require_loaded(", or use the attention backend 'xla'")
    values = value_dtype(kv_cache.dtype, kv_dtype)
    if values.name not in CACHE_FORMATS:
        raise ValueError(
            f"cpu_native attention reads float32, bfloat16 and float8 (e4m3fn, e5m2) caches, not {values}"
        )
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    if attention_chunk_size is not None and attention_chunk_size <= 0:
        raise ValueError(f"attention_chunk_size must be positive, got {attention_chunk_size}")
    rows_dtype = q.dtype if q.dtype == jnp.bfloat16 else jnp.dtype(jnp.float32)  # the kernel's two
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, rows_dtype))
    out = call(
        q.astype(rows_dtype),
        kv_cache,
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        jnp.reshape(num_seqs, (1,)).astype(jnp.int32),
        jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32),
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
        attention_chunk=np.int32(attention_chunk_size or 0),
        cache_format=np.int32(CACHE_FORMATS[values.name]),
    )
    return out.astype(q.dtype)
