# SPDX-License-Identifier: Apache-2.0
"""Dense layers in C++: bfloat16 weights (`dense.cc`) packed once, products on Intel AMX tiles,
with AVX-512 BF16 vectors, or with AVX2 FMA on values widened to float32 (in registers for up to
8 rows, a column panel at a time for more: `dense_avx2.h`); float32 weights (`dense_f32.cc`)
packed once, products with AVX2 FMA.

XLA:CPU's bfloat16 dots use none of these, and stream a single row's weights at a few GB/s;
`native_dense` computes `x [M, K] @ kernel [K, N]` with float32 accumulation and a float32 result,
the contract of `models.linear.matmul`. The kernel is packed once (`pack_dense_kernel`) into the
layout both instructions read; `native_dense_reference` computes the same product in plain JAX from
the packed form (the oracle in tests).

XLA:CPU's float32 dots reach a fraction of the FMA peak for a few rows (decode batches, short
prompts); the float32 kernel keeps 4 to 6 rows of 16 columns in registers and keeps the FMA
units busy from a few rows on (`pack_dense_kernel_f32`
packs its `[N/16, K, 16]` panels; `native_dense` takes either packed form).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.build import DENSE_F32_TARGET, DENSE_ISAS, DENSE_TARGET, require_loaded

DEPTH_MULTIPLE = 32  # K: one tile row holds 32 bfloat16 values
COLUMN_MULTIPLE = 16  # N: one tile holds 16 float32 results a row


def can_pack(shape: tuple[int, ...], dtype: jnp.dtype) -> bool:
    """Whether a `[K, N]` kernel of this shape and dtype can run on `native_dense`."""
    return (
        len(shape) == 2
        and jnp.dtype(dtype) == jnp.bfloat16
        and shape[0] % DEPTH_MULTIPLE == 0
        and shape[1] % COLUMN_MULTIPLE == 0
    )


def pack_dense_kernel(kernel: jax.Array) -> jax.Array:
    """`[K, N]` bfloat16 -> `[N/16, K/2, 16, 2]`: 16-column tiles, pairs of rows interleaved."""
    if not can_pack(kernel.shape, kernel.dtype):
        raise ValueError(
            f"native dense layers take a bfloat16 [K, N] kernel with K a multiple of {DEPTH_MULTIPLE} "
            f"and N of {COLUMN_MULTIPLE}, not {kernel.dtype} {tuple(kernel.shape)}"
        )
    k, n = kernel.shape
    return kernel.reshape(k // 2, 2, n // COLUMN_MULTIPLE, COLUMN_MULTIPLE).transpose(2, 0, 3, 1)


def can_pack_f32(shape: tuple[int, ...], dtype: jnp.dtype) -> bool:
    """Whether a `[K, N]` kernel of this shape and dtype can run on the float32 `native_dense`."""
    return len(shape) == 2 and jnp.dtype(dtype) == jnp.float32 and shape[1] % COLUMN_MULTIPLE == 0


def pack_dense_kernel_f32(kernel: jax.Array) -> jax.Array:
    """`[K, N]` float32 -> `[N/16, K, 16]`: each 16-column panel contiguous, row after row."""
    if not can_pack_f32(kernel.shape, kernel.dtype):
        raise ValueError(
            f"the float32 native dense kernel takes a float32 [K, N] kernel with N a multiple of "
            f"{COLUMN_MULTIPLE}, not {kernel.dtype} {tuple(kernel.shape)}"
        )
    k, n = kernel.shape
    return kernel.reshape(k, n // COLUMN_MULTIPLE, COLUMN_MULTIPLE).transpose(1, 0, 2)


def unpack_dense_kernel(packed: jax.Array) -> jax.Array:
    """The `[K, N]` kernel back from `pack_dense_kernel`'s (or `pack_dense_kernel_f32`'s) layout."""
    if packed.ndim == 3:
        blocks, depth, cols = packed.shape
        return packed.transpose(1, 0, 2).reshape(depth, blocks * cols)
    blocks, pairs, cols, two = packed.shape
    return packed.transpose(1, 3, 0, 2).reshape(pairs * two, blocks * cols)


def native_dense_reference(x: jax.Array, packed: jax.Array) -> jax.Array:
    """`x [M, K] @ kernel`, float32, from the packed kernel, in plain JAX."""
    return jnp.einsum("mk,kn->mn", x, unpack_dense_kernel(packed), preferred_element_type=jnp.float32)


def layer_shape(
    operand: jax.Array, layer: int | None, rank: int, name: str = "packed kernel"
) -> tuple[int, ...]:
    """The shape of the one layer a native dense call reads from `operand`: its own (`layer`
    None), or for a stack of every layer's (`[L, ...]`, `rank + 1` dimensions), layer `layer`'s.
    The kernel reads that layer in place (an offset into the stack): no copy of its weights."""
    if layer is None:
        return tuple(operand.shape)
    if operand.ndim != rank + 1 or not 0 <= layer < operand.shape[0]:
        raise ValueError(
            f"layer {layer} of a stacked {name} needs a [L, ...] stack of {rank + 1} dimensions with "
            f"L > {layer}, not {tuple(operand.shape)}; pass layer=None for a single layer's"
        )
    return tuple(operand.shape[1:])


def native_dense(
    x: jax.Array, packed: jax.Array, *, isa: str | None = None, layer: int | None = None
) -> jax.Array:
    """`x [M, K] @ kernel` in float32, `packed` from `pack_dense_kernel`, or with `layer` the
    stack `[L, ...]` of every layer's packed kernels, of which layer `layer` is read in place.

    `isa` picks the path ("amx", "avx512_bf16" or "avx2"); None takes the best one `dense_isa` reports.
    A float32 kernel (from `pack_dense_kernel_f32`) runs on AVX2 FMA, its only path.
    Trailing rows of x that are all zero (a step's padding tokens) are written as zero rows
    without being multiplied (exact for finite weights).
    Needs the native kernels loaded (`pallas_kernels.cpu.load`) on a CPU where `dense_isa` is not
    None; a path the CPU lacks fails when the program runs.
    """
    require_loaded()
    if packed.ndim == 3 or (layer is not None and packed.ndim == 4 and packed.dtype == jnp.float32):
        return _native_dense_f32(x, packed, isa, layer)
    codes = {name: code for code, name in DENSE_ISAS.items()}
    if isa is not None and isa not in codes:
        raise ValueError(f"isa must be one of {sorted(codes)} or None, not {isa!r}")
    blocks, pairs, cols, two = layer_shape(packed, layer, 4)
    if x.ndim != 2 or x.shape[1] != pairs * two or cols != COLUMN_MULTIPLE or two != 2:
        raise ValueError(f"x {tuple(x.shape)} does not match a packed kernel {tuple(packed.shape)}")
    call = jax.ffi.ffi_call(DENSE_TARGET, jax.ShapeDtypeStruct((x.shape[0], blocks * cols), jnp.float32))
    return call(
        x.astype(jnp.bfloat16),
        packed.astype(jnp.bfloat16),
        isa=np.int32(codes.get(isa, 0)),
        layer=np.int32(layer or 0),
    )


def _native_dense_f32(x: jax.Array, packed: jax.Array, isa: str | None, layer: int | None) -> jax.Array:
    if isa not in (None, "avx2"):
        raise ValueError(f"a float32 kernel runs on the avx2 path only, not {isa!r}")
    blocks, depth, cols = layer_shape(packed, layer, 3)
    if x.ndim != 2 or x.shape[1] != depth or cols != COLUMN_MULTIPLE or packed.dtype != jnp.float32:
        raise ValueError(f"x {tuple(x.shape)} does not match a packed float32 kernel {tuple(packed.shape)}")
    call = jax.ffi.ffi_call(DENSE_F32_TARGET, jax.ShapeDtypeStruct((x.shape[0], blocks * cols), jnp.float32))
    return call(x.astype(jnp.float32), packed, layer=np.int32(layer or 0))
