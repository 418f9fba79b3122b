# SPDX-License-Identifier: Apache-2.0
"""4-bit integer weights (W4A16): int4 values with a float32 scale per output channel or per group
of inputs of each channel, in int8's layouts (`models.int8`), from pre-quantized checkpoints.

A kernel `[..., in, out]` is held as `jnp.int4` values `q` in [-8, 7] and a float32 scale `s`
(`[..., out]` per channel, `[..., in / G, out]` per group of `G` inputs), `w ~ q * s`. The
product is int8's (`models.int8.int8_dot`): every int4 value is exact in bfloat16, the convert
to the activations' dtype sits inside the program next to the dot, and the scale multiplies the
float32 product (per group when grouped). XLA's TPU and GPU backends store `s4` arrays two
values a byte and fuse the int4 -> bfloat16 convert into the dot's operand, so a layer's
weights cross memory as 4 bits with no weight-sized bfloat16 temporary. On the host NumPy keeps
`ml_dtypes.int4` one value a byte; the device's buffers are half that (the planner counts half
a byte a weight).

On XLA:CPU the values are held as int8 instead (`held_dtype`): its buffers keep int4 one value
a byte anyway, and its ahead-of-time compiled programs refuse committed int4 arguments (their
layout differs from the one the executable declares). As int8 they are exactly the same
weights (`w = q * s`), packed two a byte for the native CPU int4 dense kernel where it takes
them (`pallas_kernels.cpu.native_dense_int4`, which applies the offsets below itself), else run
by the int8 one.

Affine 4-bit weights (zero points or per-group minimums: AWQ, asymmetric GPTQ, GGUF's Q4_1
and Q4_K) are the same values and scales plus a float32 offset
`m` per group and output (`kernel_offset`, the scale's layout): `w = q * s + m` (`m = (8 - z) *
s` for a zero point `z` of unsigned values, GGUF's block minimum plus `8 * s`). The product
never materializes `w`: `x @ w = int8_dot(x, q, s) + (each group's sum of x) @ m`
(`offset_product`), the scaled int4 product every format shares plus a small `[T, in / G] x
[in / G, out]` dot that only layers with offsets pay.

Checkpoints pack the values eight to an int32 (compressed-tensors' `pack-quantized`, GPTQ),
each offset by 8 into [0, 15] (`unpack_int32`), so a symmetric checkpoint's values are
int4 as they stand: the loaders unpack them on the host as each tensor is read.

The functions take NumPy arrays (at load) or JAX arrays and tracers alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from models.int8 import SCALE_DTYPE, _xp, dequantize, group_size

INT4_DTYPE = np.dtype(ml_dtypes.int4)
INT4_MIN, INT4_MAX = -8, 7
OFFSET = 8  # what the packed formats add to a value to store it unsigned
VALUES_PER_WORD = 8  # int4 values in an int32


def is_int4(dtype) -> bool:
    """Whether `dtype` is the 4-bit weights' dtype (`ml_dtypes.int4`, `jnp.int4`)."""
    return np.dtype(dtype) == INT4_DTYPE


def held_dtype(backend: str | None = None) -> np.dtype:
    """The dtype 4-bit values are held in on `backend` ("cpu", "tpu", "cuda"...; None: JAX's
    default backend): int4 (two a byte) on TPU and GPU, int8 on CPU (see the module docstring)."""
    return np.dtype(np.int8) if (backend or jax.default_backend()) == "cpu" else INT4_DTYPE


def quantizer_held(backend: str | None = None):
    """`quantize` with its values in `held_dtype(backend)` (the served model's)."""

    def quantize_held(kernel, group_size: int | None = None) -> tuple:
        q, scale = quantize(kernel, group_size)
        return q.astype(held_dtype(backend)), scale

    return quantize_held


def quantize_grouped(kernel, group_size: int) -> tuple:
    """`kernel [..., in, out]` -> int4 `q [..., in, out]`, float32 `s [..., in / G, out]`:
    symmetric, `s = max|w| / 7.5` per column and run of `group_size` inputs (compressed-tensors'
    symmetric range: the largest magnitude lands between -8 and 7), `q = round(w / s)` clipped
    to [-8, 7]. An all-zero group gets scale 1."""
    *lead, inputs, outputs = kernel.shape
    if group_size < 1 or inputs % group_size:
        raise ValueError(f"a kernel of {inputs} inputs does not split into groups of {group_size}")
    xp = _xp(kernel)
    w = kernel.astype(np.float32).reshape(*lead, inputs // group_size, group_size, outputs)
    amax = xp.max(xp.abs(w), axis=-2, keepdims=True)
    scale = xp.where(amax > 0, amax / ((INT4_MAX - INT4_MIN) / 2), np.float32(1)).astype(SCALE_DTYPE)
    q = xp.clip(xp.round(w / scale), INT4_MIN, INT4_MAX).astype(INT4_DTYPE)
    return q.reshape(kernel.shape), scale[..., 0, :]


def quantize_per_channel(kernel) -> tuple:
    """`quantize_grouped` with one group of every input: float32 `s [..., out]`."""
    q, scale = quantize_grouped(kernel, kernel.shape[-2])
    return q, scale[..., 0, :]


def quantize(kernel, group_size: int | None = None) -> tuple:
    """`quantize_grouped` with `group_size`, else `quantize_per_channel`."""
    return quantize_per_channel(kernel) if group_size is None else quantize_grouped(kernel, group_size)


def unpack_int32(packed: np.ndarray, axis: int = -1, length: int | None = None) -> np.ndarray:
    """int32 words of eight 4-bit fields each, the first in the lowest bits, every field a value
    plus 8 -> the values as `int4`, the words' `axis` eight times as long (trimmed to `length`
    when given: a padded last word). compressed-tensors packs a weight `[out, in / 8]` on its
    inputs and a zero point on its outputs; GPTQ's `qweight` is `[in / 8, out]`."""
    fields = unpack_unsigned(packed, axis)
    values = (fields.astype(np.int8) - OFFSET).astype(INT4_DTYPE)
    if length is not None:
        values = np.take(values, np.arange(length), axis=axis)
    return values


def pack_int32(values: np.ndarray) -> np.ndarray:
    """int4 values `[rows, n]` (n a multiple of 8) -> int32 `[rows, n / 8]`, each value plus 8 in
    a 4-bit field, the first lowest: compressed-tensors' `pack-quantized` weight layout, the
    inverse of `unpack_int32`."""
    fields = (np.asarray(values).astype(np.int8) + OFFSET).astype(np.uint32)
    rows, n = fields.shape
    if n % VALUES_PER_WORD:
        raise ValueError(f"{n} values a row do not pack into int32 words of {VALUES_PER_WORD}")
    words = fields.reshape(rows, n // VALUES_PER_WORD, VALUES_PER_WORD)
    shifts = np.arange(VALUES_PER_WORD, dtype=np.uint32) * 4
    return np.bitwise_or.reduce(words << shifts, axis=-1).view(np.int32)


def unpack_unsigned(packed: np.ndarray, axis: int = -1) -> np.ndarray:
    """int32 words -> their eight 4-bit fields as uint8 in [0, 15], the first lowest, along
    `axis` (eight times as long)."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    axis = axis % words.ndim
    shifts = np.arange(VALUES_PER_WORD, dtype=np.uint32) * 4
    fields = (words[..., None] >> shifts) & 0xF  # [..., 8] after the packed axis's words
    fields = np.moveaxis(fields, -1, axis + 1)
    shape = list(words.shape)
    shape[axis] *= VALUES_PER_WORD
    return fields.reshape(shape).astype(np.uint8)


def offset_product(x: jax.Array, offset: jax.Array) -> jax.Array:
    """`x [T, in]` times an affine kernel's offsets, in float32: `(sum of x over each group of
    inputs) @ offset [in / G, out]`, or per channel (`offset [out]`) each row's sum times the
    offsets. Computed at full float32 precision: the offsets may nearly cancel the scaled values'
    product, and a bfloat16 pass over the sums would show in the difference."""
    offset = offset.astype(jnp.float32)
    x = x.astype(jnp.float32)
    if offset.ndim == 1:
        return jnp.sum(x, axis=-1, keepdims=True) * offset
    sums = x.reshape(x.shape[0], offset.shape[0], -1).sum(axis=-1)  # [T, in / G]
    return jnp.einsum(
        "tg,gf->tf", sums, offset, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
    )


def affine_from_zero_points(scale: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """The offsets `m = (8 - z) * s` (float32) of unsigned 4-bit values `u` with zero points `z`
    and scales `s` (`w = (u - z) * s`), held as `q = u - 8`: `w = q * s + m`."""
    return ((OFFSET - zeros.astype(np.float32)) * scale.astype(np.float32)).astype(SCALE_DTYPE)


def dequantize_affine(q, scale, offset, dtype=np.float32):
    """`q * s + m` in `dtype` (float32 by default), per channel or grouped (`models.int8.dequantize`)."""
    w = dequantize(q, scale)
    size = group_size(q.shape, scale.shape)
    m = offset.astype(np.float32)
    if size is None:
        return (w + m[..., None, :]).astype(dtype)
    xp = _xp(q)
    return (w + xp.repeat(m, size, axis=-2)).astype(dtype)
