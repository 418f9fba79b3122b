# SPDX-License-Identifier: Apache-2.0
"""The int8-weight dense kernel (`dense_int8.cc`, AVX-512 VNNI, AVX-512 BF16, AVX-512 and AVX2): its
packed layout, a hand-worked product, the VNNI path's fixed-point reference on hand-worked rows,
then every path the CPU has against NumPy's `x @ (q * s)` over a
grid of shapes (1 to 130 rows around its 6-row register blocks, the rows from which AVX-512 BF16
widens panels ahead and the chunks of rows that reuse them; odd depths for the one-row blocks that
split even and odd k and for the register path that takes them; 16-column counts around the
4-block AVX-512 register blocks), bfloat16 and float32 activations; trailing zero rows; and a tiny
model with its int8 kernels packed for the native kernel against the same model on XLA's int8
dots."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import load_model, pack_for_native_dense
from models.int8 import dequantize, quantize_grouped
from models.linear import Linear, PackedKernel
from models.loader import put_on_device
from models.quantization import quantize_int8
from pallas_kernels import cpu
from pallas_kernels.cpu.dense_int8 import (
    fixed_point_error_bound,
    native_dense_int8_fixed_point_reference,
    quantize_rows_fixed_point,
    split_fixed_point,
    unpack_dense_kernel_int8,
)
from tests.grids import split_product
from tests.models.tiny_checkpoints import caches, prompts, run_step, save_tiny


@functools.cache
def _every_path(isas: tuple[str, ...]):
    """One program a grid point's shape: every path's product and both references (a compile is
    mostly a fixed price; run eagerly, a reference would compile each of its operations)."""

    def run(x, packed, scale):
        products = [cpu.native_dense_int8(x, packed, scale, isa=isa) for isa in isas]
        fixed_point = native_dense_int8_fixed_point_reference(x, packed, scale)
        return products, fixed_point, cpu.native_dense_int8_reference(x, packed, scale)

    return jax.jit(run)


@pytest.fixture(scope="module")
def int8_isas(native_kernels):
    isas = cpu.dense_int8_isas(native_kernels)
    if not isas:
        pytest.skip("this CPU (or its kernel) has neither AVX-512 nor AVX2 with FMA")
    return isas


def test_packed_layout_puts_each_element_where_the_panels_read_it():
    kernel = (np.arange(5 * 48) % 255 - 127).astype(np.int8).reshape(5, 48)
    packed = cpu.pack_dense_kernel_int8(kernel)
    assert isinstance(packed, np.ndarray) and packed.shape == (3, 5, 16) and packed.dtype == np.int8
    for k, n in [(0, 0), (1, 0), (0, 1), (2, 17), (4, 47), (3, 16), (1, 15)]:
        assert packed[n // 16, k, n % 16] == kernel[k, n]  # panel n // 16, row k, column n % 16
    np.testing.assert_array_equal(unpack_dense_kernel_int8(jnp.asarray(packed)), kernel)


@pytest.mark.parametrize(("shape", "dtype"), [((48, 40), np.int8), ((64, 32), np.float32), ((64,), np.int8)])
def test_kernels_the_int8_kernel_cannot_take_are_refused_by_name(shape, dtype):
    assert not cpu.can_pack_int8(shape, dtype)
    with pytest.raises(ValueError, match=r"int8 \[K, N\] kernel with N a multiple of 16"):
        cpu.pack_dense_kernel_int8(np.zeros(shape, dtype))


def test_fixed_point_reference_on_hand_worked_rows():
    # row 0: max 1, so x16 = rint(x * 32639): 32639, -16319.5 -> -16320 (ties to even),
    # 8159.75 -> 8160, 0; row 1: all zero (sx = 0); row 2: max 2, x16 = 32639 and -16320 (rint(-16319.5))
    x = jnp.asarray([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 0.0, -1.0, 0.0]], jnp.float32)
    fixed, step = quantize_rows_fixed_point(x)
    np.testing.assert_array_equal(fixed, [[32639, -16320, 8160, 0], [0, 0, 0, 0], [32639, 0, -16320, 0]])
    np.testing.assert_allclose(step, [1 / 32639, 0.0, 2 / 32639], rtol=1e-7)
    high, low = split_fixed_point(fixed)
    # 32639 = 256 * 127 + 127; -16320 = 256 * -64 + 64; 8160 = 256 * 32 - 32
    np.testing.assert_array_equal(high[0], [127, -64, 32, 0])
    np.testing.assert_array_equal(low[0], [127, 64, -32, 0])
    # column n of q is (1, 2, 3, 4) * (n - 8), scale 0.5:
    # row 0: x16 @ q = (32639 - 32640 + 24480) (n - 8) = 24479 (n - 8), y = 24479 / 32639 (n - 8) / 2
    q = (np.arange(1, 5)[:, None] * (np.arange(16) - 8)[None, :]).astype(np.int8)
    y = native_dense_int8_fixed_point_reference(x, cpu.pack_dense_kernel_int8(q), jnp.full(16, 0.5))
    np.testing.assert_allclose(y[0], 24479 / 32639 * (np.arange(16) - 8) / 2, rtol=1e-6)
    np.testing.assert_array_equal(y[1], 0.0)
    np.testing.assert_allclose(y[2], 2 * (32639 - 3 * 16320) / 32639 * (np.arange(16) - 8) / 2, rtol=1e-6)
    # the float product (0.75 (n - 8) / 2 for row 0) is within the bound
    float_y = np.asarray(x, np.float64) @ q * 0.5
    assert np.all(np.abs(np.asarray(y) - float_y) <= fixed_point_error_bound(x, q, np.full(16, 0.5)))


def test_vnni_is_listed_where_the_cpu_has_it(int8_isas):
    flags = open("/proc/cpuinfo").read().split("\n\n")[0]
    has = all(f" {flag}" in flags for flag in ("avx512f", "avx512bw", "avx512_vnni", "avx512vbmi"))
    assert ("avx512_vnni" in int8_isas) == has
    assert int8_isas[0] == "avx512_vnni" or not has


def test_hand_worked_product(int8_isas):
    # x row r is all r + 1 over 3 columns; q column n is all n - 16, scale n + 1:
    # y[r, n] = 3 (r + 1)(n - 16)(n + 1).
    x = jnp.asarray(np.repeat(np.arange(1, 8, dtype=np.float32)[:, None], 3, axis=1), jnp.bfloat16)
    q = np.tile(np.arange(-16, 16, dtype=np.int8), (3, 1))
    scale = jnp.arange(1, 33, dtype=jnp.float32)
    packed = cpu.pack_dense_kernel_int8(q)
    expected = 3 * np.outer(np.arange(1, 8), np.arange(-16, 16) * np.arange(1, 33))
    for isa in int8_isas:
        y = jax.jit(cpu.native_dense_int8, static_argnames="isa")(x, packed, scale, isa=isa)
        if isa == "avx512_vnni":  # x16 = 32639 throughout, sx = (r + 1) / 32639: float32 rounding
            np.testing.assert_allclose(y, expected, rtol=3e-7)
        else:
            np.testing.assert_array_equal(y, expected)


ROWS = (1, 2, 3, 5, 6, 7, 8, 9, 13, 31, 64, 130)
KERNELS = ((1, 16), (7, 48), (33, 80), (96, 112), (576, 960), (1535, 64), (1536, 48))
# Each point runs every path the CPU has. The fast tier takes each path once: between the two
# types of x every leftover of the 6-row blocks (1 to 6 rows), one row's split chains, VNNI's
# 3-row blocks (to 3 rows) and 6-row ones, the panels widened ahead (past 8 rows of bfloat16 x)
# and their reuse over many rows, odd depths, and every kernel shape once; the slow tier the
# whole product.
BFLOAT16_FAST = {(1, (1, 16)), (2, (7, 48)), (5, (96, 112)), (31, (33, 80)), (130, (576, 960))}
FLOAT32_FAST = {(3, (1535, 64)), (6, (1, 16)), (13, (576, 960)), (64, (1536, 48))}
BFLOAT16_GRID = split_product(ROWS, KERNELS, BFLOAT16_FAST)
FLOAT32_GRID = split_product(ROWS, KERNELS, FLOAT32_FAST)


@pytest.mark.parametrize(
    ("x_dtype", "rows", "depth", "width"),
    [
        pytest.param(jnp.bfloat16, *p.values, marks=p.marks, id="-".join(map(str, ("bfloat16", *p.values))))
        for p in BFLOAT16_GRID
    ]
    + [
        pytest.param(jnp.float32, *p.values, marks=p.marks, id="-".join(map(str, ("float32", *p.values))))
        for p in FLOAT32_GRID
    ],
)
def test_kernel_matches_numpy(int8_isas, x_dtype, rows, depth, width):
    rng = np.random.default_rng(rows * 7919 + depth + width)
    x = jnp.asarray(rng.standard_normal((rows, depth)), x_dtype)
    q = rng.integers(-127, 128, (depth, width)).astype(np.int8)
    scale = (rng.random(width) * 0.02 + 1e-3).astype(np.float32)
    # float64 on the values the kernel reads (x rounded to bfloat16 or float32, the int8 values, the
    # scales): only the kernel's float32 accumulation differs
    expected = np.asarray(x, np.float64) @ (q.astype(np.float64) * scale.astype(np.float64))
    bound = np.abs(np.asarray(x, np.float64)) @ (np.abs(q.astype(np.float64)) * scale)
    packed = jnp.asarray(cpu.pack_dense_kernel_int8(q))
    products, fixed_point, reference = _every_path(int8_isas)(x, packed, jnp.asarray(scale))
    for isa, got in zip(int8_isas, products, strict=True):
        assert got.shape == (rows, width) and got.dtype == jnp.float32
        error = np.abs(np.asarray(got, np.float64) - expected)
        if isa == "avx512_vnni":  # exact integer products: x's 16-bit rounding, then float32 rounding
            assert np.all(error <= fixed_point_error_bound(x, q, scale) + 1e-30), isa
            np.testing.assert_allclose(got, fixed_point, rtol=5e-7, atol=1e-30)
        else:  # float32 accumulation: an error below depth ulps of the sum of |products|
            assert np.all(error <= 2e-7 * depth * bound + 1e-30), isa
    np.testing.assert_allclose(reference, expected, rtol=1e-5, atol=1e-5 * np.sqrt(depth))


@pytest.fixture(scope="module")
def vnni(int8_isas):
    if "avx512_vnni" not in int8_isas:
        pytest.skip("this CPU (or its kernel) has no AVX-512 VNNI with VBMI")


def test_vnni_is_the_default_for_bfloat16_x_and_not_for_float32(vnni):
    rng = np.random.default_rng(11)
    q = rng.integers(-127, 128, (64, 32)).astype(np.int8)
    packed, scale = jnp.asarray(cpu.pack_dense_kernel_int8(q)), jnp.asarray(rng.random(32), jnp.float32)
    run = jax.jit(cpu.native_dense_int8, static_argnames="isa")
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    np.testing.assert_array_equal(run(x, packed, scale), run(x, packed, scale, isa="avx512_vnni"))
    x32 = x.astype(jnp.float32)
    np.testing.assert_array_equal(run(x32, packed, scale), run(x32, packed, scale, isa="avx512"))
    assert not np.array_equal(run(x, packed, scale, isa="avx512_vnni"), run(x, packed, scale, isa="avx512"))


def test_many_rows_of_bfloat16_x_default_to_amx_tiles_where_the_cpu_has_them(int8_isas):
    flags = set(open("/proc/cpuinfo").read().split("\n\n")[0].split())
    assert ("amx" in int8_isas) == ({"amx_tile", "amx_bf16", "avx512_bf16"} <= flags)
    if "amx" not in int8_isas:
        pytest.skip("this CPU (or its kernel) has no AMX bfloat16 tiles")
    rng = np.random.default_rng(13)
    q = rng.integers(-127, 128, (96, 48)).astype(np.int8)
    packed, scale = jnp.asarray(cpu.pack_dense_kernel_int8(q)), jnp.asarray(rng.random(48), jnp.float32)
    run = jax.jit(cpu.native_dense_int8, static_argnames="isa")
    for rows, default in [(16, "avx512_vnni"), (17, "amx"), (40, "amx")]:  # a decode step's rows: VNNI
        x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.bfloat16)
        np.testing.assert_array_equal(
            run(x, packed, scale), run(x, packed, scale, isa=default), err_msg=str(rows)
        )
    # the float product of x and q: the "avx512_bf16" path's panels, summed in another order
    tiles, vectors = (np.asarray(run(x, packed, scale, isa=isa)) for isa in ("amx", "avx512_bf16"))
    np.testing.assert_allclose(tiles, vectors, rtol=0, atol=1e-5 * np.abs(vectors).max())


@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32])
def test_many_rows_with_group_scales_default_to_amx_tiles_on_rounded_weights(int8_isas, scale_dtype):
    """GGUF Q8_0's blocks (a float16 scale per 32 k; the embedded model's LM head): past 16 rows the
    default runs them on AMX tiles, each value times its group's scale rounded to bfloat16, as a
    bfloat16 checkpoint of the same weights holds them; up to 16 rows, VNNI's integer products."""
    if "amx" not in int8_isas:
        pytest.skip("this CPU (or its kernel) has no AMX bfloat16 tiles")
    rng = np.random.default_rng(17)
    depth, width, group = 576, 96, 32
    q = rng.integers(-127, 128, (depth, width)).astype(np.int8)
    scale = (rng.random((depth // group, width)) * 0.02 + 1e-3).astype(scale_dtype)
    weights = q.astype(np.float32) * np.repeat(scale.astype(np.float32), group, axis=0)  # exact
    packed = jnp.asarray(cpu.pack_dense_kernel_int8(q))
    run = jax.jit(cpu.native_dense_int8, static_argnames="isa")
    for rows, default in [(16, "avx512_vnni"), (17, "amx"), (64, "amx")]:
        x = jnp.asarray(rng.standard_normal((rows, depth)), jnp.bfloat16)
        got = np.asarray(run(x, packed, jnp.asarray(scale)), np.float64)
        np.testing.assert_array_equal(got, run(x, packed, jnp.asarray(scale), isa=default), err_msg=str(rows))
    x64 = np.asarray(x, np.float64)
    bound = np.abs(x64) @ np.abs(weights.astype(np.float64))
    rounded = x64 @ bfloat16_values(weights)
    assert np.all(np.abs(got - rounded) <= 2e-7 * depth * bound)
    assert not np.array_equal(got, np.asarray(run(x, packed, jnp.asarray(scale), isa="avx512")))


def test_vnni_error_bound_is_far_below_bfloat16_rounding(vnni):
    """x's 16-bit rounding bounds the error at a small part of the error bfloat16 x already carries
    (its rounding, half an ulp: 2^-8 relative, of every product): a fortieth on rows of normal
    values, under a quarter on rows with an outlier 20x their spread (as hidden states have); the
    median error found is a hundredth (a twentieth with the outlier) of the output's own bfloat16
    rounding."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((8, 576))
    x[4:, 7] = 20.0
    x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    q = rng.integers(-127, 128, (576, 960)).astype(np.int8)
    scale = rng.random(960) * 0.01
    carried = 2.0**-8 * np.abs(x) @ (np.abs(q) * scale)
    bound = fixed_point_error_bound(x, q, scale)
    assert np.all(bound[:4] <= 0.025 * carried[:4]) and np.all(bound[4:] <= 0.25 * carried[4:])
    expected = x @ (q * scale)
    packed = jnp.asarray(cpu.pack_dense_kernel_int8(q))
    got = np.asarray(
        cpu.native_dense_int8(jnp.asarray(x, jnp.bfloat16), packed, jnp.asarray(scale, jnp.float32))
    )
    error = np.abs(got - expected)
    assert np.all(error <= bound)
    relative = error / (2.0**-8 * np.abs(expected))
    assert np.median(relative[:4]) < 0.01 and np.median(relative[4:]) < 0.05


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan, 1e-35], ids=["inf", "-inf", "nan", "tiny"])
def test_vnni_leaves_what_its_fixed_point_cannot_hold_to_the_float_product(vnni, value):
    """A value that is not finite gives what the float product gives (inf or nan where it meets a
    weight, nothing silent), and so does a row too small for the fixed point's step."""
    rng = np.random.default_rng(13)
    q = rng.integers(-127, 128, (40, 32)).astype(np.int8)
    q[3, :16] = 0  # inf * 0: nan
    packed, scale = jnp.asarray(cpu.pack_dense_kernel_int8(q)), jnp.asarray(rng.random(32) + 0.5, jnp.float32)
    x = rng.standard_normal((4, 40)).astype(np.float32)
    x[2] = x[2] * 1e-36 if value == 1e-35 else x[2]
    x[2, 3] = value
    x = jnp.asarray(x, jnp.bfloat16)
    run = jax.jit(cpu.native_dense_int8, static_argnames="isa")
    got = np.asarray(run(x, packed, scale, isa="avx512_vnni"))
    np.testing.assert_array_equal(got, run(x, packed, scale, isa="avx512"))
    if value == 1e-35:
        assert np.all(np.isfinite(got)) and np.any(got[2] != 0)
    else:
        assert np.all(np.isnan(got[2, :16])) and not np.any(np.isfinite(got[2, 16:]))
        assert np.all(np.isfinite(got[[0, 1, 3]]))


def test_grouped_scales_reference_on_a_hand_worked_case():
    # K = 8 in two groups of 4; x = (1, ..., 1, 2, ..., 2); column n of q all n + 1; group scales
    # 1 and 0.5: y[n] = 4 (n + 1) * 1 + 8 (n + 1) * 0.5 = 8 (n + 1)
    x = jnp.asarray([[1.0] * 4 + [2.0] * 4], jnp.bfloat16)
    q = np.tile(np.arange(1, 17, dtype=np.int8), (8, 1))
    scale = jnp.asarray([[1.0] * 16, [0.5] * 16])
    packed = cpu.pack_dense_kernel_int8(q)
    np.testing.assert_allclose(cpu.native_dense_int8_reference(x, packed, scale)[0], 8 * np.arange(1, 17))
    # fixed point: x16 = 16320 (16319.5 to even) then 32639; y = 2 / 32639 (16320 * 4 + 32639 * 2) (n + 1)
    expected = 2 / 32639 * (16320 * 4 + 32639 * 2) * np.arange(1, 17)
    np.testing.assert_allclose(
        native_dense_int8_fixed_point_reference(x, packed, scale)[0], expected, rtol=1e-6
    )


GROUPED = ((32, 48, 4), (64, 80, 32), (576, 96, 32), (96, 16, 96), (1536, 64, 128))


def amx_rounds_weights(rows: int, depth: int, group: int) -> bool:
    """Whether an "amx" call of bfloat16 x multiplies `q s` rounded to bfloat16: scales per group
    (one group is a scale per column: exact), K a multiple of the tile depth (32), and more than 8
    rows (from which it widens panels ahead; at fewer it runs as "avx512_bf16" does)."""
    return rows > 8 and depth % 32 == 0 and group < depth


def bfloat16_values(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest even), as float64."""
    return np.asarray(jnp.asarray(values, jnp.float32).astype(jnp.bfloat16), np.float64)


GROUPED_ROWS = (1, 2, 5, 7, 13, 64)


# The fast tier: one row (VNNI's one-row grouped blocks), 3 + 2 rows, and the widened panels past
# 8 rows at the smallest group, the embedded model's and a GPTQ-like one; the slow tier the whole
# product.
GROUPED_FAST = {(1, (32, 48, 4)), (5, (576, 96, 32)), (13, (1536, 64, 128)), (64, (32, 48, 4))}


@pytest.mark.parametrize(
    ("rows", "depth", "width", "group"), split_product(GROUPED_ROWS, GROUPED, GROUPED_FAST)
)
def test_grouped_scales_match_numpy(int8_isas, rows, depth, width, group):
    rng = np.random.default_rng(rows * 31 + depth + group)
    x = jnp.asarray(rng.standard_normal((rows, depth)), jnp.bfloat16)
    q = rng.integers(-127, 128, (depth, width)).astype(np.int8)
    scale = (rng.random((depth // group, width)) * 0.02 + 1e-3).astype(np.float32)
    weights = q.astype(np.float64) * np.repeat(scale.astype(np.float64), group, axis=0)  # q_kn s_kn
    x64 = np.asarray(x, np.float64)
    expected, bound = x64 @ weights, np.abs(x64) @ np.abs(weights)
    packed = jnp.asarray(cpu.pack_dense_kernel_int8(q))
    products, fixed_point, reference = _every_path(int8_isas)(x, packed, jnp.asarray(scale))
    for isa, got in zip(int8_isas, products, strict=True):
        error = np.abs(np.asarray(got, np.float64) - expected)
        if isa == "avx512_vnni":
            assert np.all(error <= fixed_point_error_bound(x, q, scale) + 1e-30), isa
            np.testing.assert_allclose(got, fixed_point, rtol=2e-6, atol=1e-6 * np.abs(expected).max())
        elif isa == "amx" and amx_rounds_weights(rows, depth, group):
            # on the tiles: q s rounded to bfloat16, then the float product
            rounded = x64 @ bfloat16_values(q.astype(np.float32) * np.repeat(scale, group, axis=0))
            assert np.all(np.abs(np.asarray(got, np.float64) - rounded) <= 2e-7 * depth * bound + 1e-30), isa
            assert np.all(error <= 2.0**-8 * bound + 2e-7 * depth * bound + 1e-30), isa
        else:
            assert np.all(error <= 2e-7 * depth * bound + 1e-30), isa
    np.testing.assert_allclose(reference, expected, rtol=1e-5, atol=1e-5 * np.sqrt(depth))


@pytest.mark.parametrize("shape", [(5, 16), (2, 16), (4, 32)], ids=["not-dividing", "odd-group", "columns"])
def test_grouped_scales_that_do_not_fit_are_refused(native_kernels, shape):
    packed = cpu.pack_dense_kernel_int8(np.zeros((12, 16), np.int8))  # K = 12: groups of 4 or 12
    with pytest.raises(ValueError, match=r"scale|grouped scales"):
        cpu.native_dense_int8(jnp.ones((1, 12)), packed, jnp.ones(shape))


def test_trailing_zero_rows_give_zero_rows(int8_isas):
    rng = np.random.default_rng(5)
    q = rng.integers(-127, 128, (96, 64)).astype(np.int8)
    scale = jnp.asarray(rng.random(64).astype(np.float32))
    packed = cpu.pack_dense_kernel_int8(q)
    x = np.zeros((9, 96), np.float32)
    x[:4] = rng.standard_normal((4, 96))
    x[4, -1] = 1.0  # zero but for its last value: multiplied
    x[6] = -0.0

    @jax.jit
    def after_another_product(first, x):
        total = cpu.native_dense_int8(first, packed, scale).sum()  # its buffer may serve the second
        return cpu.native_dense_int8(x, packed, scale), total

    got, _ = after_another_product(jnp.ones((9, 96), jnp.bfloat16), jnp.asarray(x, jnp.bfloat16))
    x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    expected = x @ (q * np.asarray(scale, np.float64))
    assert np.all(np.abs(np.asarray(got) - expected) <= fixed_point_error_bound(x, q, scale) + 1e-6)
    np.testing.assert_array_equal(np.asarray(got)[5:], 0.0)


# A whole model a dtype: float32's is the slow tier's (the kernel grid above covers both dtypes)
@pytest.mark.parametrize(
    "dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16], ids=["float32", "bfloat16"]
)
def test_packed_int8_model_equals_the_xla_int8_model(dense_kernels, int8_isas, dtype, tmp_path):
    """Every int8 Linear packs for the native kernel (scales beside them) and the logits equal
    those of the same int8 weights on XLA's dots: both multiply the same int8 values by the same
    activations, in float32 (to float32 rounding) or bfloat16 activations (to 2% of the largest
    logit, as the bfloat16 native kernel against XLA's bfloat16 dots: a hidden state's bfloat16
    rounding flips where the two sum in another order)."""
    path = save_tiny("Qwen3ForCausalLM", str(tmp_path / "qwen3"))  # a tied head: its int8 copy packs too
    config, native = load_model(path, dtype, on_host=True)
    quantize_int8(native)
    _, xla = load_model(path, dtype, on_host=True)
    quantize_int8(xla)
    packed = pack_for_native_dense(native)
    linears = [m for _, m in nnx.iter_modules(native) if isinstance(m, Linear)]
    assert packed >= len(linears) > 0
    for module in linears:
        assert isinstance(module.kernel, PackedKernel) and module.kernel[...].dtype == np.int8
        assert module.kernel_scale[...].dtype == np.float32
    head = native.model.embed_tokens
    assert isinstance(head.head_kernel, PackedKernel) and head.head_kernel[...].dtype == np.int8
    put_on_device(native)
    put_on_device(xla)
    (ids,) = prompts([40], seed=3)
    pages = [[1, 2, 3]]
    got, _ = run_step(native, caches(config), [ids], [0], pages)
    expected, _ = run_step(xla, caches(config), [ids], [0], pages)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)
    else:  # a bfloat16 rounding that flips between the two compounds over the layers
        np.testing.assert_allclose(got, expected, atol=0.02 * np.abs(expected).max())


@pytest.mark.parametrize("group, packs", [(32, True), (8, True), (6, False)])
def test_grouped_linear_packs_only_for_group_sizes_the_kernel_takes(int8_isas, group, packs):
    rng = np.random.default_rng(11)
    kernel = rng.standard_normal((96, 32)).astype(np.float32)
    linear = Linear(96, 32, bias=False, dtype=jnp.float32)
    q, scale = quantize_grouped(kernel, group)
    linear.kernel, linear.kernel_scale = nnx.Param(jnp.asarray(q)), nnx.Param(jnp.asarray(scale))
    x = jnp.asarray(rng.standard_normal((3, 96)), jnp.bfloat16)
    on_xla = np.asarray(linear.product(x))
    assert pack_for_native_dense(linear) == int(packs)
    assert isinstance(linear.kernel, PackedKernel) == packs
    expected = np.asarray(x, np.float32) @ dequantize(q, scale)
    np.testing.assert_allclose(on_xla, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(linear.product(x)), expected, rtol=1e-3, atol=1e-3)
