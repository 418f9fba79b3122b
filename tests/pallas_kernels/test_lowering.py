# SPDX-License-Identifier: Apache-2.0
"""Lowering of the Pallas kernels for TPU and CUDA in this process, without the compile toolchains.

The real compilers check far more (tests/aot/test_compile_kernels_*.py: Mosaic's VMEM budget,
Triton's shared-memory limit, the compiled program's memory, on every grid case), but they run
only where `make aot-toolchains` installed them, in subprocesses. What `jax.export` adds here: a
check that needs neither libtpu nor the CUDA plugin, in the ordinary test process, of the
Pallas -> Mosaic lowering rules (the (8, 128) block rule that interpret mode ignores) and the
Pallas -> Triton ones (power-of-two tiles), so a checkout without the toolchains still catches a
kernel edit that no longer lowers. Two configurations a kernel: the compile tests hold the grid.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import gpu, tpu
from pallas_kernels.gpu.layout import padded_head_dim as gpu_lanes
from pallas_kernels.tpu.layout import padded_head_dim as tpu_lanes

NUM_SLOTS, CONTEXT, NUM_Q_HEADS, NUM_KV_HEADS = 64, 2048, 8, 2
TRITON_CALL = "__gpu$xla.gpu.triton"

CONFIGS = [
    # (dtype, cache dtype, page size, head dim, tokens, sliding window, soft cap)
    (jnp.bfloat16, jnp.bfloat16, 16, 128, 256, None, None),
    (jnp.bfloat16, jnp.float8_e5m2, 32, 256, 64, 1024, 30.0),
]
IDS = [
    f"{jnp.dtype(c[0]).name}-{jnp.dtype(c[1]).name}-page{c[2]}-d{c[3]}-t{c[4]}{'-window-cap' if c[5] else ''}"
    for c in CONFIGS
]
PARAMS = ("dtype", "kv_dtype", "page_size", "head_dim", "num_tokens", "window", "cap")


def _shapes(dtype, kv_dtype, page_size, head_dim, num_tokens, cache_shape):
    pages_per_seq = CONTEXT // page_size
    return (
        jax.ShapeDtypeStruct((num_tokens, NUM_Q_HEADS, head_dim), dtype),
        jax.ShapeDtypeStruct(cache_shape, kv_dtype),
        jax.ShapeDtypeStruct((NUM_SLOTS,), jnp.int32),
        jax.ShapeDtypeStruct((NUM_SLOTS, pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((NUM_SLOTS + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )


@pytest.mark.parametrize(PARAMS, CONFIGS, ids=IDS)
def test_tpu_kernel_lowers_to_mosaic(dtype, kv_dtype, page_size, head_dim, num_tokens, window, cap):
    num_pages = NUM_SLOTS * CONTEXT // page_size
    cache = (num_pages, 2 * NUM_KV_HEADS, page_size, tpu_lanes(head_dim))
    f = functools.partial(
        tpu.ragged_paged_attention, sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=cap
    )
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(
        *_shapes(dtype, kv_dtype, page_size, head_dim, num_tokens, cache)
    )
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize(PARAMS, CONFIGS, ids=IDS)
def test_gpu_kernel_lowers_to_triton(dtype, kv_dtype, page_size, head_dim, num_tokens, window, cap):
    num_pages = NUM_SLOTS * CONTEXT // page_size
    cache = (2, NUM_KV_HEADS, num_pages, page_size, gpu_lanes(head_dim))
    f = functools.partial(
        gpu.ragged_paged_attention, sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=cap
    )
    exported = jax.export.export(
        jax.jit(f),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )(*_shapes(dtype, kv_dtype, page_size, head_dim, num_tokens, cache))
    assert TRITON_CALL in exported.mlir_module()
