# SPDX-License-Identifier: Apache-2.0
"""Dense layers with 4-bit weights in C++ (`dense_int4.cc`): `x [M, K] @ w` in float32 with
`w = q * s + m`, q int4 in [-8, 7], s float32 per group of G consecutive k and column (`[K/G, N]`,
or `[N]`: one group of all of K) and m an optional float32 offset of the scale's layout (affine
4-bit: AWQ, asymmetric GPTQ, GGUF Q4_1 and Q4_K, `models.int4`). x stays bfloat16 or float32.

Scales and offsets may come as float16 instead, and the offsets as each group's base b (the
weight of stored value 0, m - 8 s: `w = (q + 8) s + b`): GGUF Q4_0 and Q4_1 blocks hold d and
their minimum (Q4_0: -8 d) in float16, exactly such a scale and base, where m = minimum + 8 d
would not be exact in float16. `float16_scales` converts float32 scales and offsets to that form,
refusing any it would round; the kernel then computes the weights the float32 form gives
(bitwise where the bases are exact), streaming 0.625 bytes a weight at 32 inputs a group
instead of 0.75.

XLA:CPU holds int4 one value a byte and converts a quantized kernel to a float copy in memory
before its dot; the native kernel reads the values packed two a byte and unpacks them in
registers, so a decode step reads each weight as half a byte. The kernel is packed once
(`pack_dense_kernel_int4`) into `[N/16, K/8, 16]` uint32 words, eight consecutive k of one column
a word, each stored unsigned (q + 8), byte b holding k = b in its low nibble and k = b + 4 in its
high one (the order VPMADDUBSW takes them in); `native_dense_int4_reference` computes the same
product in plain JAX from the packed form (the oracle in tests).

With bfloat16 x the AVX2 path multiplies integers: each row of x in 16-bit fixed point
(`quantize_rows_fixed_point`, as the int8 kernel's VNNI path rounds it) against the unsigned
values, the one error next to the float product x's rounding, at most `sx / 2 sum_k |u_k s_k|`
per output (`fixed_point_error_bound`); "avx512_vnni" (the default where the CPU has AVX-512 VNNI
and VBMI) takes the same fixed point to VPDPBUSD, four products to an int32 lane and no int16
stage, so 32-input groups leave a decode step bound by the weights' bytes; "avx512_float" (the
default for float32 x where the CPU has AVX-512), "avx2_float" and "portable" compute the float
product.
With more rows of bfloat16 x, "avx512_bf16" (the default where the CPU has it) widens each panel
once to its unsigned values in bfloat16 (exact) and multiplies on VDPBF16PS: the float product at
bfloat16's throughput, where the AVX2 paths dequantize to float32; "amx" (where the CPU has AMX
bfloat16 tiles, the default past 16 rows there) widens each panel the same way and multiplies
every row on AMX tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.build import DENSE_INT4_ISAS, DENSE_INT4_TARGET, require_loaded
from pallas_kernels.cpu.dense import layer_shape

COLUMN_MULTIPLE = 16  # N: one packed line holds 16 columns
DEPTH_MULTIPLE = 8  # K, and a group of k: one packed word holds 8 consecutive k
INT4_MIN, INT4_MAX = -8, 7
NIBBLE_AT = (0, 8, 16, 24, 4, 12, 20, 28)  # the bit where the k-th value of a word starts
FIXED_POINT_LEVELS = 32639  # |x16| <= 32639: 256 hi + lo with both planes signed bytes
BLOCK_LEVELS = 127  # the one-plane path's |x8| per block


def _xp(array):  # NumPy for host arrays (a streamed or host load), jax.numpy for everything else
    return np if isinstance(array, np.ndarray) else jnp


def dense_int4_takes_groups(group_size: int) -> bool:
    """Whether `native_dense_int4` takes scales grouped by `group_size` consecutive k."""
    return group_size >= 1 and group_size % DEPTH_MULTIPLE == 0


def can_pack_int4(shape: tuple[int, ...]) -> bool:
    """Whether a `[K, N]` kernel of int4 values (held in any integer dtype) of this shape can run
    on `native_dense_int4`: K a multiple of 8, N of 16."""
    return len(shape) == 2 and shape[0] % DEPTH_MULTIPLE == 0 and shape[1] % COLUMN_MULTIPLE == 0


def pack_dense_kernel_int4(kernel):
    """`[K, N]` int4 values (int4, or int8 holding them) -> `[N/16, K/8, 16]` uint32: each
    16-column panel contiguous, eight k a word, k at bit `NIBBLE_AT[k % 8]` as q + 8 (NumPy in,
    NumPy out). A host kernel with a value outside [-8, 7] is refused."""
    if not can_pack_int4(kernel.shape) or not jnp.issubdtype(kernel.dtype, jnp.integer):
        raise ValueError(
            f"the int4 native dense kernel takes an integer [K, N] kernel with K a multiple of "
            f"{DEPTH_MULTIPLE} and N of {COLUMN_MULTIPLE}, not {kernel.dtype} {tuple(kernel.shape)}"
        )
    xp = _xp(kernel)
    values = kernel.astype(xp.int32)
    on_host = isinstance(kernel, np.ndarray) and values.size
    if on_host and (values.min() < INT4_MIN or values.max() > INT4_MAX):
        raise ValueError(
            f"the int4 native dense kernel takes values in [{INT4_MIN}, {INT4_MAX}], not "
            f"[{values.min()}, {values.max()}]: an int8 kernel runs on native_dense_int8"
        )
    k, n = kernel.shape
    unsigned = ((values + 8) & 0xF).astype(xp.uint32).reshape(k // DEPTH_MULTIPLE, DEPTH_MULTIPLE, n)
    shifts = xp.asarray(NIBBLE_AT, dtype=xp.uint32)[None, :, None]
    words = (unsigned << shifts).sum(axis=1, dtype=xp.uint32)  # disjoint bits: the sum is their OR
    return xp.transpose(words.reshape(k // DEPTH_MULTIPLE, n // COLUMN_MULTIPLE, COLUMN_MULTIPLE), (1, 0, 2))


def unpack_dense_kernel_int4(packed: jax.Array) -> jax.Array:
    """The `[K, N]` int8 values back from `pack_dense_kernel_int4`'s layout."""
    blocks, words, cols = packed.shape
    shifts = jnp.asarray(NIBBLE_AT, dtype=jnp.uint32)
    nibbles = (packed[:, :, None, :] >> shifts[None, None, :, None]) & 0xF  # [N/16, K/8, 8, 16]
    values = nibbles.astype(jnp.int32) - 8
    return values.transpose(1, 2, 0, 3).reshape(words * DEPTH_MULTIPLE, blocks * cols).astype(jnp.int8)


def float16_scales(scale, offset=None) -> tuple:
    """float32 scales `s` and offsets `m` (None: 0) -> float16 `s` and bases `b = m - 8 s` (the
    weight of stored value 0, computed in float32 as the kernel computes it from `m`), for
    `native_dense_int4(..., base=b)`: the same weights in 4 bytes a group instead of 8 (NumPy in,
    NumPy out). Host arrays are checked: every scale must be exact in float16, and every base
    within one float32 ulp of its `m` (the rounding `m` itself carries: a Q4_1 block's minimum
    + 8 d rounded to float32 gives back its float16 minimum but where the two differ by more than
    2^13 times, and then the float32 form is off from the file by as much); any other is refused,
    naming how many (AWQ's and GPTQ's `z s`, Q4_K's `d sc`: those stay float32)."""
    xp = _xp(scale)
    scale = scale.astype(xp.float32)
    offset = xp.zeros_like(scale) if offset is None else offset.astype(xp.float32)
    base = scale * xp.float32(-8) + offset
    halves = scale.astype(xp.float16), base.astype(xp.float16)
    if isinstance(scale, np.ndarray):  # a traced one is taken as fitting: its host load checks it
        scales = int(np.sum(halves[0].astype(np.float32) != scale))
        bases = int(np.sum(np.abs(halves[1].astype(np.float32) - base) > np.spacing(np.abs(offset))))
        if scales or bases:
            raise ValueError(
                f"float16 would round {scales} of {scale.size} int4 scales and {bases} bases (m - 8 s) "
                "by more than their float32 form carries: keep these scales in float32"
            )
    return halves


def _grouped(values: jax.Array) -> jax.Array:
    """Scales or offsets `[N]` or `[K/G, N]` as float32 `[groups, N]`."""
    return values.astype(jnp.float32).reshape(-1, values.shape[-1])


def native_dense_int4_reference(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    offset: jax.Array | None = None,
    *,
    base: jax.Array | None = None,
) -> jax.Array:
    """`x [M, K] @ (q * s + m)`, float32, from the packed kernel, in plain JAX: each group of
    k's product with its values times its scales, plus each row's sum over the group times the
    group's offsets (`base`: `m = b + 8 s`, in float32)."""
    if base is not None:
        offset = _grouped(base) + 8 * _grouped(scale)
    q = unpack_dense_kernel_int4(packed).astype(jnp.float32)
    scale = _grouped(scale)
    groups, (rows, depth) = scale.shape[0], x.shape
    xs = x.astype(jnp.float32).reshape(rows, groups, depth // groups)
    partial = jnp.einsum("mgk,gkn->mgn", xs, q.reshape(groups, depth // groups, -1), precision="highest")
    y = jnp.einsum("mgn,gn->mn", partial, scale, precision="highest")
    if offset is None:
        return y
    return y + jnp.einsum("mg,gn->mn", xs.sum(axis=2), _grouped(offset), precision="highest")


def fixed_point_error_bound(x, q, scale) -> np.ndarray:
    """How far x's rounding to 16-bit fixed point moves the AVX2 path's `[M, N]` result with
    bfloat16 x from the float product, in float64 on the host: at most sx / 2 a value of x
    (sx = max|x_row| / 32639) times `sum_k |u_k s_k|` (u = q + 8, the values it multiplies; the
    base m - 8 s meets x's exact sums). `q` is the `[K, N]` kernel's values, `scale` `[N]` or
    `[K/G, N]`; float32 rounding comes on top."""
    x = np.asarray(x, np.float64)
    unsigned = np.asarray(q, np.float64) + 8
    scale = np.abs(np.asarray(scale, np.float64)).reshape(-1, unsigned.shape[1])
    weights = unsigned * np.repeat(scale, unsigned.shape[0] // scale.shape[0], axis=0)
    step = np.abs(x).max(axis=1, keepdims=True) / FIXED_POINT_LEVELS
    return step / 2 * weights.sum(axis=0)


def x_block_size(group: int) -> int:
    """The k of one 8-bit block of x on the one-plane path (`x_bits=8`) for weights grouped by
    `group` k: 32 (llama.cpp's Q8_1), or 16 or 8 where the groups do not split into 32s."""
    return 32 if group % 32 == 0 else 16 if group % 16 == 0 else 8


def quantize_x_blocks(x, group: int) -> tuple[np.ndarray, np.ndarray]:
    """x `[M, K]` as the one-plane path rounds it, on the host: each block of `x_block_size(group)`
    k to `dx = max|x_block| / 127` (float32) and `x8 = rint(x / dx)` (ties to even; 0 for a block
    of zeros). Returns x8 `[M, K]` int8 and dx `[M, K / block]` float32."""
    x = np.asarray(x, np.float32)
    rows, depth = x.shape
    blocks = x.reshape(rows, depth // x_block_size(group), -1)
    largest = np.abs(blocks).max(axis=2)
    inverse = np.where(largest > 0, np.float32(BLOCK_LEVELS) / np.where(largest > 0, largest, 1), 0)
    levels = np.clip(np.rint(blocks * inverse.astype(np.float32)[:, :, None]), -BLOCK_LEVELS, BLOCK_LEVELS)
    step = (largest / np.float32(BLOCK_LEVELS)).astype(np.float32)
    return levels.astype(np.int8).reshape(rows, depth), step


def block_int8_error_bound(x, q, scale) -> np.ndarray:
    """How far x's rounding to 8 bits a block (`quantize_x_blocks`) moves the one-plane path's
    `[M, N]` result from the float product, in float64 on the host: at most dx_b / 2 a value of x
    in block b times `sum_{k in b} |u_k s_k|` (u = q + 8; the base meets x's exact sums).
    `q` is the `[K, N]` kernel's values, `scale` `[N]` or `[K/G, N]`; float32 rounding comes on
    top."""
    depth = np.shape(q)[0]
    scale = np.abs(np.asarray(scale, np.float64)).reshape(-1, np.shape(q)[1])
    group = depth // scale.shape[0]
    weights = (np.asarray(q, np.float64) + 8) * np.repeat(scale, group, axis=0)
    block = x_block_size(group)
    x = np.abs(np.asarray(x, np.float64))
    step = x.reshape(x.shape[0], depth // block, block).max(axis=2) / BLOCK_LEVELS
    return step / 2 @ weights.reshape(depth // block, block, -1).sum(axis=1)


def native_dense_int4(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    offset: jax.Array | None = None,
    *,
    base: jax.Array | None = None,
    isa: str | None = None,
    x_bits: int | None = None,
    layer: int | None = None,
) -> jax.Array:
    """`x [M, K] @ (q * s + m)` in float32, `packed` from `pack_dense_kernel_int4`, `scale [N]`
    (one per column) or `[K/G, N]` (one per group of G consecutive k and column, G a multiple of
    8 that divides K: GGUF's 32, GPTQ's and AWQ's 128), `offset` None or of the scale's shape;
    or instead of `offset`, `base` (`b = m - 8 s`, the weight of stored value 0: `w = (q + 8) s + b`).
    float16 scales with float16 offsets or bases (or none) are read as they are (`float16_scales`);
    other dtypes are converted to float32.

    x is bfloat16 or another float dtype (converted to float32). `isa` picks the path
    ("avx512_vnni", "amx", "avx512_bf16", "avx2", "avx512_float", "avx2_float" or "portable"); None
    takes the best the CPU has (`dense_int4_isas`; float32 x skips the integer and bfloat16
    products, whose precision is finer than bfloat16's rounding but coarser than float32's:
    "avx512_bf16" runs it as "avx512_float" where the CPU has it, else "avx2_float"; "avx512_vnni"
    runs more than 16 rows as "avx512_bf16" where the CPU has it,
    else as "avx2"). On "avx2" and "avx512_bf16" up to 8 rows, and on "avx512_vnni" up to 16, x is
    rounded to 16-bit fixed point (`fixed_point_error_bound`); a
    call with a value of x that is not finite, or a row whose largest magnitude is below 1e-30
    but not zero, runs the float product instead. Trailing rows of x that are all zero are
    written as zero rows without being multiplied, as in `native_dense`.
    `x_bits` 8 runs "avx512_vnni" with x in one signed byte a value per block of 32 k (16 or 8
    where the groups do not split into 32s: `quantize_x_blocks`, llama.cpp's Q8_1): half the
    integer products of the two planes, its error at most `block_int8_error_bound`; 16 keeps the
    two planes; None leaves the choice to the kernel (`kOnePlaneRowsAtMost` in `dense_int4.cc`,
    0: the two planes at every row count). A block it cannot hold (a
    largest magnitude below 1e-30) runs on the two planes.
    With `layer`, `packed`, `scale` and `offset` (or `base`) are the stacks `[L, ...]` of every
    layer's, of which layer `layer`'s are read in place (`dense.layer_shape`).
    Needs the native kernels loaded (`pallas_kernels.cpu.load`); a path the CPU lacks fails when
    the program runs.
    """
    require_loaded()
    if x_bits not in (None, 8, 16):
        raise ValueError(f"x_bits must be 8, 16 or None, not {x_bits!r}")
    codes = {name: code for code, name in DENSE_INT4_ISAS.items()}
    if isa is not None and isa not in codes:
        raise ValueError(f"isa must be one of {sorted(codes)} or None, not {isa!r}")
    blocks, words, cols = layer_shape(packed, layer, 3)
    depth, width = words * DEPTH_MULTIPLE, blocks * cols
    scale_shape = layer_shape(scale, layer, max(scale.ndim - (layer is not None), 1), "int4 scale")
    groups = scale_shape[0] if len(scale_shape) == 2 else 1
    if offset is not None and base is not None:
        raise ValueError("give native_dense_int4 an offset m or a base m - 8 s, not both")
    bases = base is not None
    offset = base if bases else offset
    if (
        x.ndim != 2
        or x.shape[1] != depth
        or cols != COLUMN_MULTIPLE
        or packed.dtype != jnp.uint32
        or scale_shape not in ((width,), (groups, width))
        or (offset is not None and offset.shape != scale.shape)
    ):
        raise ValueError(
            f"x {tuple(x.shape)}, scale {tuple(scale.shape)} and offset "
            f"{None if offset is None else tuple(offset.shape)} do not match a packed int4 kernel "
            f"{packed.dtype} {tuple(packed.shape)} ([K = {depth}, N = {width}]): scale is [N] or "
            "[K/G, N], offset None or the scale's shape"
        )
    if groups < 1 or depth % groups or not dense_int4_takes_groups(depth // groups):
        raise ValueError(
            f"grouped scales {tuple(scale.shape)} need groups of a multiple of {DEPTH_MULTIPLE} consecutive "
            f"k that divide K = {depth}: [K/G, N] with G % {DEPTH_MULTIPLE} == 0"
        )
    x = x if x.dtype == jnp.bfloat16 else x.astype(jnp.float32)
    half = scale.dtype == jnp.float16 and (offset is None or offset.dtype == jnp.float16)
    dtype = jnp.float16 if half else jnp.float32
    offset = jnp.zeros((0,), dtype) if offset is None else offset.astype(dtype)
    call = jax.ffi.ffi_call(DENSE_INT4_TARGET, jax.ShapeDtypeStruct((x.shape[0], width), jnp.float32))
    return call(
        x,
        packed,
        scale.astype(dtype),
        offset,
        isa=np.int32(codes.get(isa, 0)),
        bases=np.int32(bases),
        x_bits=np.int32(x_bits or 0),
        layer=np.int32(layer or 0),
    )
