# SPDX-License-Identifier: Apache-2.0
"""Cross-lowering of the Pallas kernels for real devices, without one.

`jax.export(..., platforms=["tpu"])` runs the real Pallas -> Mosaic lowering (it enforces the
(8, 128) block rule that interpret mode ignores) and `platforms=["cuda"]` the Pallas -> Triton
lowering (it enforces power-of-two tile shapes). Neither runs libtpu's Mosaic compiler or
Triton -> PTX, so VMEM/register limits and layout support stay unchecked until real hardware.
Shapes are a realistic step: head dim 128, 8 query heads over 2 kv heads, 64 sequence slots,
2048-token contexts; 256 tokens (mixed) and 64 (decode bucket, the decode tuning defaults).
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
    (jnp.bfloat16, jnp.bfloat16, 32, 128, 64, 1024, 30.0),
    (jnp.float32, jnp.float32, 16, 128, 64, None, None),
    (jnp.float32, jnp.float32, 32, 64, 256, 512, 50.0),
    (jnp.bfloat16, jnp.bfloat16, 16, 256, 256, 4096, 50.0),  # Gemma-style head dim 256
    # Float8 caches (vLLM's kv_cache_dtype "fp8", "fp8_e5m2"): 32-token pages, the 8-bit TPU tile.
    (jnp.bfloat16, jnp.float8_e4m3fn, 32, 128, 256, None, None),
    (jnp.bfloat16, jnp.float8_e5m2, 32, 128, 64, 1024, 30.0),
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


def test_kv_writes_lower_for_tpu_and_cuda():
    k = jax.ShapeDtypeStruct((256, NUM_KV_HEADS, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((256,), jnp.int32)
    for module, platform in ((tpu, "tpu"), (gpu, "cuda")):
        for kv_dtype, page_size in ((jnp.bfloat16, 16), (jnp.float8_e4m3fn, 32)):
            cache = jax.eval_shape(
                lambda m=module, d=kv_dtype, s=page_size: m.allocate_kv_cache(4096, s, NUM_KV_HEADS, 128, d)
            )
            exported = jax.export.export(jax.jit(module.write_kv, donate_argnums=0), platforms=[platform])(
                cache, k, k, slots
            )
            assert "scatter" in exported.mlir_module()
