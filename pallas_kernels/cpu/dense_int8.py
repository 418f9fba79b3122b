# SPDX-License-Identifier: Apache-2.0
"""Dense layers with int8 weights in C++ (`dense_int8.cc`): `(x [M, K] @ q [K, N]) * s [N]` in
float32, q int8 with one float32 scale per output column, or `s [K/G, N]` per group of G
consecutive k and column (W8A16: x stays bfloat16 or float32).

XLA:CPU converts an int8 kernel to a bfloat16 copy in memory every step before its dot, which
costs more than int8's halved bytes save; the native kernel widens the int8 values in registers
(AVX-512 or AVX2) as they stream, so a decode step reads each weight once, as one byte. The kernel
is packed once (`pack_dense_kernel_int8`) into `[N/16, K, 16]` panels (the float32 kernel's
layout, one byte a value); `native_dense_int8_reference` computes the same product in plain JAX
from the packed form (the oracle in tests).

With AVX-512 VNNI ("avx512_vnni", bfloat16 x) the kernel multiplies integers: each row of x in
16-bit fixed point (`quantize_rows_fixed_point`), the products with VPDPBUSD in int32, exact; the
one error next to the float product is x's rounding to 16 bits, at most `s[n] sx / 2 sum_k |q_kn|`
(`fixed_point_error_bound`). `native_dense_int8_fixed_point_reference` computes that product in
plain JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.build import DENSE_INT8_ISAS, DENSE_INT8_TARGET, require_loaded
from pallas_kernels.cpu.dense import layer_shape

COLUMN_MULTIPLE = 16  # N: one packed row holds 16 columns
FIXED_POINT_LEVELS = 32639  # |x16| <= 32639: 256 hi + lo with both planes signed bytes


def _xp(array):  # NumPy for host arrays (a streamed or host load), jax.numpy for everything else
    return np if isinstance(array, np.ndarray) else jnp


GROUP_MULTIPLE = 4  # grouped scales: G a multiple of the 4 k one VPDPBUSD lane sums


def dense_int8_takes_groups(group_size: int) -> bool:
    """Whether `native_dense_int8` takes scales grouped by `group_size` consecutive k."""
    return group_size >= 1 and group_size % GROUP_MULTIPLE == 0


def can_pack_int8(shape: tuple[int, ...], dtype: jnp.dtype) -> bool:
    """Whether a `[K, N]` kernel of this shape and dtype can run on `native_dense_int8`."""
    return len(shape) == 2 and jnp.dtype(dtype) == jnp.int8 and shape[1] % COLUMN_MULTIPLE == 0


def pack_dense_kernel_int8(kernel):
    """`[K, N]` int8 -> `[N/16, K, 16]`: each 16-column panel contiguous, row after row (NumPy in,
    NumPy out)."""
    if not can_pack_int8(kernel.shape, kernel.dtype):
        raise ValueError(
            f"the int8 native dense kernel takes an int8 [K, N] kernel with N a multiple of "
            f"{COLUMN_MULTIPLE}, not {kernel.dtype} {tuple(kernel.shape)}"
        )
    k, n = kernel.shape
    return _xp(kernel).transpose(kernel.reshape(k, n // COLUMN_MULTIPLE, COLUMN_MULTIPLE), (1, 0, 2))


def unpack_dense_kernel_int8(packed: jax.Array) -> jax.Array:
    """The `[K, N]` int8 kernel back from `pack_dense_kernel_int8`'s layout."""
    blocks, depth, cols = packed.shape
    return packed.transpose(1, 0, 2).reshape(depth, blocks * cols)


def float16_int8_scales(scale):
    """float32 int8 scales -> float16 ones for `native_dense_int8` (NumPy in, NumPy out): the same
    product in half the scales' bytes. Host arrays are checked: every scale must be exact in
    float16 (a GGUF Q8_0 block's d is, and so is its requantization from the file's values), else
    this refuses, naming how many; a traced one is taken as fitting (its host load checks it)."""
    xp = _xp(scale)
    halves = scale.astype(xp.float16)
    if isinstance(scale, np.ndarray):
        rounded = int(np.sum(halves.astype(np.float32) != scale.astype(np.float32)))
        if rounded:
            raise ValueError(
                f"float16 would round {rounded} of {scale.size} int8 scales: keep these scales in float32"
            )
    return halves


def _grouped_scale(scale: jax.Array) -> jax.Array:
    """Scales `[N]` or `[K/G, N]` as `[groups, N]`."""
    return scale.astype(jnp.float32).reshape(-1, scale.shape[-1])


def native_dense_int8_reference(x: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """`(x [M, K] @ q) * s`, float32, from the packed kernel, in plain JAX; with scales `[K/G, N]`
    each group of G consecutive k is multiplied by its own row of scales."""
    q = unpack_dense_kernel_int8(packed).astype(jnp.float32)
    scale = _grouped_scale(scale)
    groups, (rows, depth) = scale.shape[0], x.shape
    xs = x.astype(jnp.float32).reshape(rows, groups, depth // groups)
    partial = jnp.einsum("mgk,gkn->mgn", xs, q.reshape(groups, depth // groups, -1), precision="highest")
    return jnp.einsum("mgn,gn->mn", partial, scale, precision="highest")


def quantize_rows_fixed_point(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (x16 [M, K] int32, sx [M] float32) with x ~ x16 * sx per row, as the VNNI path
    computes them in float32: sx = max|x_row| / 32639, x16 = rint(x * (32639 / max|x_row|)) (ties
    to even), a row of zeros giving sx = 0 and zeros."""
    values = x.astype(jnp.float32)
    largest = jnp.max(jnp.abs(values), axis=1)
    levels = jnp.float32(FIXED_POINT_LEVELS)
    inverse = jnp.where(largest > 0, levels / jnp.where(largest > 0, largest, 1), 0)
    fixed = jnp.clip(jnp.rint(values * inverse[:, None]), -levels, levels).astype(jnp.int32)
    return fixed, largest / levels


def split_fixed_point(fixed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x16 -> (hi, lo) with x16 = 256 hi + lo, lo the sign-extended low byte (both in int8's range
    for |x16| <= 32639)."""
    low = (fixed & 0xFF).astype(jnp.uint8).astype(jnp.int8).astype(jnp.int32)
    return (fixed - low) >> 8, low


def native_dense_int8_fixed_point_reference(x: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """What the VNNI path computes, in plain JAX: `(256 (hi @ q) + (lo @ q)) * (s * sx)` in
    float32, each plane's product exact in int32 (at most 128 * 128 K); with scales `[K/G, N]`,
    `sx * sum_g (256 (hi_g @ q_g) + (lo_g @ q_g)) * s_g` over the groups of k."""
    fixed, step = quantize_rows_fixed_point(x)
    high, low = split_fixed_point(fixed)
    q = unpack_dense_kernel_int8(packed).astype(jnp.int32)
    scale = _grouped_scale(scale)
    groups, (rows, depth) = scale.shape[0], x.shape
    q = q.reshape(groups, depth // groups, -1)

    def plane(p):
        p = p.reshape(rows, groups, depth // groups)
        return jnp.einsum("mgk,gkn->mgn", p, q, preferred_element_type=jnp.int32).astype(jnp.float32)

    total = plane(high) * 256 + plane(low)
    if groups == 1:
        return total[:, 0] * (scale[0][None, :] * step[:, None])
    return (total * scale[None]).sum(axis=1) * step[:, None]


def fixed_point_error_bound(x, q, scale) -> np.ndarray:
    """How far the VNNI path's `[M, N]` result may be from the float product `(x @ q) * s`, in
    float64 on the host: x's rounding to 16 bits (at most sx / 2 a value) times `sum_k |q_kn s_kn|`,
    plus float32 rounding of the result. `q` is the `[K, N]` int8 kernel, `scale` `[N]` or
    `[K/G, N]`."""
    x, q = np.asarray(x, np.float64), np.abs(np.asarray(q, np.float64))
    scale = np.asarray(scale, np.float64).reshape(-1, q.shape[1])
    weights = q * np.repeat(scale, q.shape[0] // scale.shape[0], axis=0)  # |q_kn| s_kn
    step = np.abs(x).max(axis=1, keepdims=True) / FIXED_POINT_LEVELS
    return step / 2 * weights.sum(axis=0) + 2e-7 * np.abs(x) @ weights


def native_dense_int8(
    x: jax.Array, packed: jax.Array, scale: jax.Array, *, isa: str | None = None, layer: int | None = None
) -> jax.Array:
    """`(x [M, K] @ q) * s` in float32, `packed` from `pack_dense_kernel_int8`, `scale [N]` (one
    per column), or `[K/G, N]`: one per group of G consecutive k and column (G a multiple of 4 that
    divides K; GGUF Q8_0's G is 32), each group's products scaled before they are summed. Scales
    are float32, or float16 (GGUF Q8_0's own d, half the bytes) read as they are: the result is
    bit for bit what float32 copies of them give (`float16_int8_scales`); any other float dtype
    is converted to float32.

    x is bfloat16 (read as it is) or another float dtype (converted to float32). `isa` picks the
    path ("avx512_vnni", "avx512_bf16", "avx512" or "avx2"); None takes the best the CPU has
    (`dense_int8_isas`; float32 x skips "avx512_vnni", whose fixed point is finer than bfloat16's
    rounding but coarser than float32's). On "avx512_vnni" a call with a value of x that is not
    finite, a row whose largest magnitude is below 1e-30 but not zero, or K past 131072 runs the
    float product instead ("avx512"). Trailing rows of x that are all zero are written as zero rows without
    being multiplied, as in `native_dense`.
    With `layer`, `packed` and `scale` are the stacks `[L, ...]` of every layer's, of which
    layer `layer`'s are read in place (`dense.layer_shape`).
    Needs the native kernels loaded (`pallas_kernels.cpu.load`); a path the CPU lacks fails when
    the program runs.
    """
    require_loaded()
    codes = {name: code for code, name in DENSE_INT8_ISAS.items()}
    if isa is not None and isa not in codes:
        raise ValueError(f"isa must be one of {sorted(codes)} or None, not {isa!r}")
    blocks, depth, cols = layer_shape(packed, layer, 3)
    scale_shape = layer_shape(scale, layer, max(scale.ndim - (layer is not None), 1), "int8 scale")
    groups = scale_shape[0] if len(scale_shape) == 2 else 1
    if (
        x.ndim != 2
        or x.shape[1] != depth
        or cols != COLUMN_MULTIPLE
        or packed.dtype != jnp.int8
        or scale_shape not in ((blocks * cols,), (groups, blocks * cols))
    ):
        raise ValueError(
            f"x {tuple(x.shape)} and scale {tuple(scale.shape)} do not match a packed int8 kernel "
            f"{packed.dtype} {tuple(packed.shape)}: scale is [N] or [K/G, N]"
        )
    if len(scale_shape) == 2 and (
        groups < 1 or depth % groups or (groups > 1 and not dense_int8_takes_groups(depth // groups))
    ):
        raise ValueError(
            f"grouped scales {tuple(scale.shape)} need groups of a multiple of 4 consecutive k that divide "
            f"K = {depth}: [K/G, N] with G % 4 == 0"
        )
    x = x if x.dtype == jnp.bfloat16 else x.astype(jnp.float32)
    scale = scale if scale.dtype == jnp.float16 else scale.astype(jnp.float32)
    call = jax.ffi.ffi_call(DENSE_INT8_TARGET, jax.ShapeDtypeStruct((x.shape[0], blocks * cols), jnp.float32))
    return call(x, packed, scale, isa=np.int32(codes.get(isa, 0)), layer=np.int32(layer or 0))
