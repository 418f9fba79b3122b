# SPDX-License-Identifier: Apache-2.0
"""The 4-bit-weight dense kernel (`dense_int4.cc`, AVX-512 VNNI and BF16, AVX2 and portable): its
packed layout (two's-complement nibbles, eight k a word), a hand-worked product with scales and
offsets, then every path the CPU has against NumPy's `x @ (q * s + m)` in float64 over hand-picked
and random shapes (1 to 130 rows around the 3-row register blocks and the rows from which panels are
dequantized ahead; depths and widths around the 8-k words and 16-column panels; groups of 8, 32
(GGUF), 64, 128 (GPTQ, AWQ) and one per column), with and without offsets, bfloat16 and float32
activations; trailing zero rows; shapes and groups it cannot take refused by name; and a Linear
whose int4 kernel packs for it against the same Linear on XLA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from models import pack_for_native_dense
from models.int4 import dequantize_affine, quantize_grouped
from models.linear import Linear, PackedKernel, is_packed_int4
from pallas_kernels import cpu
from pallas_kernels.cpu.dense_int4 import fixed_point_error_bound, unpack_dense_kernel_int4
from pallas_kernels.cpu.dense_int8 import fixed_point_error_bound as int8_fixed_point_error_bound


@pytest.fixture(scope="module")
def int4_isas(native_kernels):
    isas = cpu.dense_int4_isas(native_kernels)
    assert "portable" in isas  # plain C++: every CPU
    return isas


def test_isas_list_avx2_and_avx512_bf16_where_the_cpu_has_them(int4_isas):
    flags = open("/proc/cpuinfo").read().split("\n\n")[0].split()
    avx2 = "avx2" in flags and "fma" in flags
    bf16 = avx2 and {"avx512f", "avx512bw", "avx512_bf16"} <= set(flags)
    vnni = avx2 and {"avx512f", "avx512bw", "avx512_vnni", "avx512vbmi"} <= set(flags)
    amx = bf16 and {"amx_tile", "amx_bf16"} <= set(flags)  # Linux grants the tiles on request
    avx512 = avx2 and "avx512f" in flags
    expected = ("avx512_vnni",) * vnni + ("amx",) * amx + ("avx512_bf16",) * bf16
    expected += ("avx2",) * avx2 + ("avx512_float",) * avx512 + ("avx2_float",) * avx2 + ("portable",)
    assert int4_isas == expected


def test_packed_layout_puts_each_value_in_its_word_and_nibble():
    kernel = (np.arange(16 * 48) % 16 - 8).astype(np.int8).reshape(16, 48)
    packed = cpu.pack_dense_kernel_int4(kernel)
    assert isinstance(packed, np.ndarray) and packed.shape == (3, 2, 16) and packed.dtype == np.uint32
    for k, n in [(0, 0), (1, 0), (7, 0), (8, 1), (15, 17), (3, 47), (9, 16)]:
        word = int(packed[n // 16, k // 8, n % 16])  # panel n // 16, word k // 8, column n % 16
        # k % 8 < 4 in the low nibble of byte k % 8, the others in the high nibble of byte k % 8 - 4
        nibble = (word >> (8 * (k % 4) + 4 * (k % 8 // 4))) & 0xF
        assert nibble - 8 == kernel[k, n]  # stored unsigned
    np.testing.assert_array_equal(unpack_dense_kernel_int4(jnp.asarray(packed)), kernel)
    # int4 values pack the same as the int8 that holds them, and a traced kernel the same too
    np.testing.assert_array_equal(cpu.pack_dense_kernel_int4(kernel.astype(ml_dtypes.int4)), packed)
    np.testing.assert_array_equal(jax.jit(cpu.pack_dense_kernel_int4)(jnp.asarray(kernel)), packed)


@pytest.mark.parametrize(
    ("shape", "dtype", "message"),
    [
        ((12, 16), np.int8, "K a multiple of 8"),
        ((16, 24), np.int8, "N of 16"),
        ((16,), np.int8, "integer"),
        ((16, 16), np.float32, "integer"),
    ],
)
def test_kernels_the_int4_kernel_cannot_take_are_refused_by_name(shape, dtype, message):
    assert not (cpu.can_pack_int4(shape) and np.issubdtype(dtype, np.integer))
    with pytest.raises(ValueError, match=message):
        cpu.pack_dense_kernel_int4(np.zeros(shape, dtype))


def test_values_outside_int4_are_refused():
    kernel = np.zeros((8, 16), np.int8)
    kernel[3, 5] = 9
    with pytest.raises(ValueError, match=r"values in \[-8, 7\].*native_dense_int8"):
        cpu.pack_dense_kernel_int4(kernel)


def test_hand_worked_product(int4_isas):
    # K = 16 in two groups of 8; x row r is all r + 1; q column n is all n - 8 (n < 16) or 7 - (n - 16);
    # scale s[g, n] = g + 1, offset m[g, n] = n / 4:
    # y[r, n] = sum_g 8 (r + 1) (q_n (g + 1) + n / 4) = 8 (r + 1) (3 q_n + n / 2).
    x = jnp.asarray(np.repeat(np.arange(1, 5, dtype=np.float32)[:, None], 16, axis=1), jnp.bfloat16)
    column = np.concatenate([np.arange(-8, 8), 7 - np.arange(16)])
    q = np.tile(column.astype(np.int8), (16, 1))
    scale = jnp.asarray(np.repeat([[1.0], [2.0]], 32, axis=1), jnp.float32)
    offset = jnp.asarray(np.tile(np.arange(32) / 4, (2, 1)), jnp.float32)
    packed = cpu.pack_dense_kernel_int4(q)
    expected = 8 * np.outer(np.arange(1, 5), 3 * column + np.arange(32) / 2)
    for isa in int4_isas:
        y = jax.jit(cpu.native_dense_int4, static_argnames="isa")(x, packed, scale, offset, isa=isa)
        if isa in _FIXED_POINT:  # x16 = 32639 throughout, sx = (r + 1) / 32639: float32 rounding
            np.testing.assert_allclose(y, expected, rtol=1e-6)
        else:
            np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(cpu.native_dense_int4_reference(x, packed, scale, offset), expected)


# The paths that round bfloat16 x to 16-bit fixed point, up to how many rows.
_FIXED_POINT = {"avx2": 8, "avx512_bf16": 8, "amx": 8, "avx512_vnni": 16}
# 5 and 13: "avx512_vnni" splits them into register blocks of 3 + 2 and 4 + 3 + 3 + 3 rows.
ROWS = (1, 2, 5, 13, 130)
# (depth, width, inputs per scale): hand-picked around the words, panels and groups, then the
# embedded model's projections (576 -> 1536 in groups of 32) and a GPTQ-like 128-group layer.
KERNELS = (
    (8, 16, 8),
    (16, 48, 8),
    (64, 16, 64),
    (96, 80, 32),
    (256, 32, 128),
    (576, 1536, 32),
    (1536, 64, 1536),
    (1024, 112, 128),
)


# The fast tier takes each path once (integer products to 8 rows, float panels past them) on the
# embedded model's shape and a per-column kernel; the slow tier the whole grid.
FAST = {(1, (576, 1536, 32)), (13, (576, 1536, 32)), (5, (1536, 64, 1536)), (130, (96, 80, 32))}
GRID = [
    pytest.param(rows, *kernel, marks=() if (rows, kernel) in FAST else pytest.mark.slow)
    for kernel in KERNELS
    for rows in ROWS
]


def _product(rng, rows, depth, width, group, x_dtype, affine):
    x = jnp.asarray(rng.standard_normal((rows, depth)), x_dtype)
    q = rng.integers(-8, 8, (depth, width)).astype(np.int8)
    scale = (rng.random((depth // group, width)) * 0.02 + 1e-3).astype(np.float32)
    offset = (rng.standard_normal(scale.shape) * 0.02).astype(np.float32) if affine else None
    if group == depth:  # one scale per column: `[N]`
        scale = scale[0]
        offset = None if offset is None else offset[0]
    scales = np.repeat(scale.reshape(-1, width), group, axis=0).astype(np.float64)
    offsets = 0 if offset is None else np.repeat(offset.reshape(-1, width), group, axis=0)
    expected = np.asarray(x, np.float64) @ (scales * q + offsets)
    # the sum of |terms| the kernel adds: x u s with u = q + 8, and x (m - 8 s)
    bound = np.abs(np.asarray(x, np.float64)) @ (scales * (q + 8) + np.abs(offsets - 8 * scales))
    return x, q, scale, offset, expected, bound


@functools.cache
def _every_path(isas: tuple[str, ...]):
    """One program a grid point's shape: every path's product and the reference's (a compile is
    mostly a fixed price, and each point's shape is compiled once)."""

    def run(x, packed, scale, offset):
        products = [cpu.native_dense_int4(x, packed, scale, offset, isa=isa) for isa in isas]
        return products, cpu.native_dense_int4_reference(x, packed, scale, offset)

    return jax.jit(run)


@pytest.mark.parametrize(
    ("x_dtype", "affine"),
    [(jnp.bfloat16, True), (jnp.float32, False)],
    ids=["bfloat16-offsets", "float32-symmetric"],
)
@pytest.mark.parametrize(("rows", "depth", "width", "group"), GRID)
def test_kernel_matches_numpy(int4_isas, x_dtype, affine, rows, depth, width, group):
    rng = np.random.default_rng(rows * 7919 + depth * 31 + width + group)
    x, q, scale, offset, expected, bound = _product(rng, rows, depth, width, group, x_dtype, affine)
    packed = jnp.asarray(cpu.pack_dense_kernel_int4(q))
    offset = None if offset is None else jnp.asarray(offset)
    # "avx512_vnni" runs many rows as "amx" or "avx512_bf16" where the CPU has them
    bf16_paths = ("avx512_bf16", "amx", "avx512_vnni") if "avx512_bf16" in int4_isas else ()
    widens_to_bf16 = lambda isa: isa in bf16_paths  # noqa: E731
    products, reference = _every_path(int4_isas)(x, packed, jnp.asarray(scale), offset)
    for isa, got in zip(int4_isas, products, strict=True):
        assert got.shape == (rows, width) and got.dtype == jnp.float32
        error = np.abs(np.asarray(got, np.float64) - expected)
        # float32 accumulation (and, from 9 rows, the weights rounded to float32 once): an error
        # below a few ulps of the sum of |terms| per group; "avx2" at a few rows multiplies x
        # rounded to 16-bit fixed point
        allowed = 4e-7 * (group + depth // group) * bound + 1e-30
        if rows <= _FIXED_POINT.get(isa, 0):
            allowed = allowed + fixed_point_error_bound(x, q, scale)
        elif widens_to_bf16(isa) and x.dtype == jnp.bfloat16:  # the weights rounded to bfloat16
            per_k = lambda values: np.repeat(np.reshape(values, (-1, width)), group, axis=0)  # noqa: E731
            weights = q * per_k(scale) + (0 if offset is None else per_k(offset))
            allowed = allowed + 2.0**-8 * (np.abs(np.asarray(x, np.float64)) @ np.abs(weights))
        assert np.all(error <= allowed), isa
    np.testing.assert_allclose(reference, expected, rtol=1e-5, atol=1e-5 * np.sqrt(depth))


def test_integer_products_are_the_default_for_bfloat16_x_and_not_for_float32(int4_isas):
    if "avx2" not in int4_isas:
        pytest.skip("this CPU (or its kernel) has no AVX2 with FMA")
    rng = np.random.default_rng(3)
    q = rng.integers(-8, 8, (256, 64)).astype(np.int8)
    scale, offset = (
        jnp.asarray(rng.random((8, 64)), jnp.float32),
        jnp.asarray(rng.random((8, 64)), jnp.float32),
    )
    packed = cpu.pack_dense_kernel_int4(q)
    product = jax.jit(cpu.native_dense_int4, static_argnames="isa")
    many_rows = next((isa for isa in ("amx", "avx512_bf16") if isa in int4_isas), "avx2")
    few_rows = "avx512_vnni" if "avx512_vnni" in int4_isas else "avx2"
    floats = "avx512_float" if "avx512_float" in int4_isas else "avx2_float"
    for dtype, rows, default in [
        (jnp.bfloat16, 2, few_rows), (jnp.bfloat16, 24, many_rows), (jnp.float32, 2, floats),
        (jnp.float32, 16, floats),
    ]:  # fmt: skip
        x = jnp.asarray(rng.standard_normal((rows, 256)), dtype)
        got = np.asarray(product(x, packed, scale, offset))
        np.testing.assert_array_equal(got, product(x, packed, scale, offset, isa=default))
    # bfloat16 x: the fixed point differs from the float product, within its bound
    x = x[:2]
    fixed, floats = (
        np.asarray(product(x.astype(jnp.bfloat16), packed, scale, offset, isa=isa))
        for isa in ("avx2", "avx2_float")
    )
    assert np.any(fixed != floats)
    bound = fixed_point_error_bound(x.astype(jnp.bfloat16), q, scale)
    assert np.all(np.abs(fixed - floats) <= bound + 1e-5 * np.abs(floats))


@pytest.mark.parametrize("value", [np.inf, np.nan, 1e-35], ids=["inf", "nan", "tiny-row"])
def test_fixed_point_leaves_what_it_cannot_hold_to_the_float_product(int4_isas, value):
    if "avx2" not in int4_isas:
        pytest.skip("this CPU (or its kernel) has no AVX2 with FMA")
    rng = np.random.default_rng(4)
    q = rng.integers(-8, 8, (64, 32)).astype(np.int8)
    scale = jnp.asarray(rng.random((2, 32)), jnp.float32)
    packed = cpu.pack_dense_kernel_int4(q)
    x = np.asarray(rng.standard_normal((2, 64)), np.float32)
    x[1] = 1e-36 if value == 1e-35 else x[1]
    x[1, 5] = value
    x = jnp.asarray(x, jnp.bfloat16)
    product = jax.jit(cpu.native_dense_int4, static_argnames="isa")
    np.testing.assert_array_equal(product(x, packed, scale), product(x, packed, scale, isa="avx2_float"))


@pytest.mark.parametrize(
    ("scale_shape", "offset_shape"),
    [((5, 16), None), ((6, 16), None), ((2, 32), None), ((3, 16), (16,)), ((16,), (1, 16))],
    ids=["not-dividing", "group-of-4", "columns", "offset-per-channel", "offset-grouped"],
)
def test_scales_and_offsets_that_do_not_fit_are_refused(native_kernels, scale_shape, offset_shape):
    packed = cpu.pack_dense_kernel_int4(np.zeros((24, 16), np.int8))  # K = 24: groups of 8 or 24
    offset = None if offset_shape is None else jnp.ones(offset_shape)
    with pytest.raises(ValueError, match=r"scale|grouped scales"):
        cpu.native_dense_int4(jnp.ones((1, 24)), packed, jnp.ones(scale_shape), offset)


def test_trailing_zero_rows_give_zero_rows(int4_isas):
    rng = np.random.default_rng(5)
    q = rng.integers(-8, 8, (96, 64)).astype(np.int8)
    scale = jnp.asarray(rng.random((3, 64)).astype(np.float32))
    offset = jnp.asarray(rng.standard_normal((3, 64)).astype(np.float32))
    packed = cpu.pack_dense_kernel_int4(q)
    x = np.zeros((9, 96), np.float32)
    x[:4] = rng.standard_normal((4, 96))
    x[4, -1] = 1.0  # zero but for its last value: multiplied
    x[6] = -0.0

    @jax.jit
    def after_another_product(first, x):
        total = cpu.native_dense_int4(first, packed, scale, offset).sum()  # its buffer may serve the second
        return cpu.native_dense_int4(x, packed, scale, offset), total

    got, _ = after_another_product(jnp.ones((9, 96), jnp.bfloat16), jnp.asarray(x, jnp.bfloat16))
    weights = dequantize_affine(q, np.asarray(scale), np.asarray(offset), np.float64)  # NumPy's, in float64
    expected = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) @ weights
    allowed = fixed_point_error_bound(x, q, scale) + 1e-5 * (1 + np.abs(expected))  # 5 rows: fixed point
    assert np.all(np.abs(np.asarray(got) - expected) <= allowed)
    np.testing.assert_array_equal(np.asarray(got)[5:], 0.0)


@pytest.mark.parametrize(
    ("depth", "group", "packs_int4"),
    [(96, 32, True), (96, 8, True), (96, 4, False), (36, 12, False)],
    ids=["g32", "g8", "g4-int8-kernel", "depth-36-int8-kernel"],
)
def test_int4_linear_packs_for_the_int4_kernel_where_it_takes_the_groups(
    dense_kernels, depth, group, packs_int4
):
    """A Linear holding 4-bit values as int8 (the CPU's `int4.held_dtype`) with scales and offsets
    packs for the int4 kernel when its depth and groups are multiples of 8, else for the int8 one
    (groups of 4); both compute `x @ (q * s + m)` as the Linear on XLA's int8 dot plus the offsets'
    product does."""
    rng = np.random.default_rng(depth + group)
    q, scale = quantize_grouped(rng.standard_normal((depth, 32)).astype(np.float32), group)
    offset = (rng.standard_normal(scale.shape) * 0.05).astype(np.float32)
    linear = Linear(depth, 32, bias=False, dtype=jnp.float32)
    linear.kernel = nnx.Param(jnp.asarray(q.astype(np.int8)))
    linear.kernel_scale, linear.kernel_offset = nnx.Param(jnp.asarray(scale)), nnx.Param(jnp.asarray(offset))
    x = jnp.asarray(rng.standard_normal((3, depth)), jnp.bfloat16)
    on_xla = np.asarray(linear.product(x))
    assert pack_for_native_dense(linear, int4=True) == 1
    assert isinstance(linear.kernel, PackedKernel) and is_packed_int4(linear.kernel[...]) == packs_int4
    expected = np.asarray(x, np.float64) @ dequantize_affine(q, scale, offset, np.float64)
    np.testing.assert_allclose(on_xla, expected, rtol=1e-4, atol=1e-4)
    # both kernels may round bfloat16 x to 16-bit fixed point: the int4 one's integer path, the
    # int8 one's VNNI path (where the CPU has it)
    rounding = (fixed_point_error_bound if packs_int4 else int8_fixed_point_error_bound)(x, q, scale)
    allowed = 1e-4 * (1 + np.abs(expected)) + rounding
    assert np.all(np.abs(np.asarray(linear.product(x)) - expected) <= allowed)
