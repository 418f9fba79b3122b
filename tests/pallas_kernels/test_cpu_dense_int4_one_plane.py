# SPDX-License-Identifier: Apache-2.0
"""The int4 kernel's one-plane path (`native_dense_int4(..., x_bits=8)`, AVX-512 VNNI): x rounded
to one signed byte per value a block of 32 k (llama.cpp's Q8_1), checked against a NumPy emulation
of that rounding (`quantize_x_blocks`, hand-worked first) in float64 and against the float product
within `block_int8_error_bound`, over rows 1 to 16, groups of 8 to 128 and per column, float32 and
float16 scales, with and without offsets; what the blocks cannot hold left to the float product;
`x_bits` refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu
from pallas_kernels.cpu.dense_int4 import block_int8_error_bound, quantize_x_blocks, x_block_size


@pytest.fixture(scope="module")
def vnni(native_kernels):
    if "avx512_vnni" not in cpu.dense_int4_isas(native_kernels):
        pytest.skip("this CPU (or its kernel) has no AVX-512 VNNI")


def test_blocks_of_x_hand_worked():
    # group 8: blocks of 8. Block 0's largest |x| is 2, dx = 2 / 127: 1 -> 63.5 -> 64 (ties to
    # even), -2 -> -127, 0.5 -> 31.75 -> 32, 0.25 -> 15.875 -> 16. Block 1 is zeros: dx 0, x8 0.
    x = np.zeros((1, 16), np.float32)
    x[0, :4] = [1.0, -2.0, 0.5, 0.25]
    levels, step = quantize_x_blocks(x, 8)
    assert levels[0, :4].tolist() == [64, -127, 32, 16] and not levels[0, 4:].any()
    np.testing.assert_array_equal(step, np.float32([[2 / 127, 0]]))
    assert [x_block_size(g) for g in (8, 16, 24, 32, 64, 96, 128, 576)] == [8, 16, 8, 32, 32, 32, 32, 32]


def _emulated(x, q, scale, offset, group):
    """The one-plane path's arithmetic in float64: each block's x8 . (u s) times dx, plus each
    group's exact sum of x times its base m - 8 s."""
    rows, depth = x.shape
    levels, step = quantize_x_blocks(x, group)
    per_k = lambda values: np.repeat(np.reshape(values, (-1, q.shape[1])), group, axis=0)  # noqa: E731
    weighted = (q.astype(np.float64) + 8) * per_k(scale)
    block = x_block_size(group)
    dx = np.repeat(step.astype(np.float64), block, axis=1)
    y = (levels * dx) @ weighted
    base = (0 if offset is None else np.reshape(offset, (-1, q.shape[1]))) - 8 * np.reshape(
        scale, (-1, q.shape[1])
    )
    return y + np.asarray(x, np.float64).reshape(rows, depth // group, group).sum(axis=2) @ base


# (rows, depth, width, group): around the 1- to 4-row register blocks, groups of 8 to 128
# (blocks of 8, 16 and 32 k), one group per column, and the embedded model's projection.
CASES = [
    (1, 576, 1536, 32),
    (2, 96, 80, 32),
    (3, 64, 16, 8),
    (4, 1024, 112, 128),
    (5, 48, 32, 24),
    (7, 64, 48, 16),
    (16, 256, 32, 64),
    (2, 1536, 64, 1536),
]


# The fast tier takes the embedded model's projection and blocks of 8; the slow tier the rest.
FAST = {(1, 576, 1536, 32), (5, 48, 32, 24)}


@pytest.mark.parametrize("half", [False, True], ids=["float32-scales", "float16-scales"])
@pytest.mark.parametrize(
    ("rows", "depth", "width", "group"),
    [pytest.param(*case, marks=() if case in FAST else pytest.mark.slow) for case in CASES],
)
def test_one_plane_matches_its_emulation_and_bound(vnni, half, rows, depth, width, group):
    rng = np.random.default_rng(rows * 131 + depth + width + group)
    x = jnp.asarray(rng.standard_normal((rows, depth)) * rng.random((rows, 1)) * 4, jnp.bfloat16)
    q = rng.integers(-8, 8, (depth, width)).astype(np.int8)
    groups = depth // group
    # Q4_1's blocks: float16 d and minimum, m = minimum + 8 d in float32 (`float16_scales` takes them)
    scale = (rng.random((groups, width)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    minimum = (-rng.random((groups, width)) * 0.2).astype(np.float16).astype(np.float32)
    offset = (minimum + 8 * scale).astype(np.float32)
    if group == depth:  # one scale per column, no offsets
        scale, offset = scale[0], None
    packed = jnp.asarray(cpu.pack_dense_kernel_int4(q))
    if half:
        half_scale, base = cpu.float16_scales(scale, offset)
        got = cpu.native_dense_int4(x, packed, jnp.asarray(half_scale), base=jnp.asarray(base), x_bits=8)
    else:
        off = None if offset is None else jnp.asarray(offset)
        got = cpu.native_dense_int4(x, packed, jnp.asarray(scale), off, x_bits=8)
    got = np.asarray(got, np.float64)
    xs = np.asarray(x, np.float64)
    per_k = lambda values: np.repeat(np.reshape(values, (-1, width)), group, axis=0)  # noqa: E731
    offsets = 0 if offset is None else per_k(offset)
    exact = xs @ (q * per_k(scale) + offsets)
    # float32 rounding: a few ulps of the sum of |terms| the kernel adds
    terms = np.abs(xs) @ (per_k(scale) * (q + 8) + np.abs(offsets - 8 * per_k(scale)))
    rounding = 4e-7 * (group + depth // group) * terms + 1e-30
    np.testing.assert_array_less(np.abs(got - _emulated(xs, q, scale, offset, group)), rounding)
    bound = block_int8_error_bound(xs, q, scale)
    assert np.all(np.abs(got - exact) <= bound + rounding)


@pytest.mark.parametrize(
    ("value", "instead"), [(np.inf, "avx2_float"), (np.nan, "avx2_float"), (1e-35, None)]
)
def test_what_the_blocks_cannot_hold_takes_the_two_planes_or_the_float_product(vnni, value, instead):
    """A block whose largest magnitude is positive but below 1e-30 (dx would be subnormal) runs on
    the two planes (16 bits a row); a value that is not finite on the float product."""
    rng = np.random.default_rng(5)
    q = rng.integers(-8, 8, (64, 32)).astype(np.int8)
    scale = jnp.asarray(rng.random((2, 32)) + 0.1, jnp.float32)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    x[1, 32:] = 0
    x[1, 40] = value  # a block whose largest magnitude is tiny, or not finite
    x = jnp.asarray(x, jnp.bfloat16)
    packed = cpu.pack_dense_kernel_int4(q)
    got = cpu.native_dense_int4(x, packed, scale, x_bits=8)
    expected = cpu.native_dense_int4(x, packed, scale, isa=instead, x_bits=None if instead else 16)
    np.testing.assert_array_equal(got, expected)


def test_x_bits_other_than_8_or_16_are_refused(native_kernels):
    packed = cpu.pack_dense_kernel_int4(np.zeros((8, 16), np.int8))
    with pytest.raises(ValueError, match="x_bits must be 8, 16 or None"):
        cpu.native_dense_int4(jnp.ones((1, 8), jnp.bfloat16), packed, jnp.ones((16,)), x_bits=4)


def test_sixteen_bits_is_the_two_plane_path(vnni):
    rng = np.random.default_rng(9)
    q = rng.integers(-8, 8, (256, 64)).astype(np.int8)
    scale = jnp.asarray(rng.random((8, 64)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    packed = cpu.pack_dense_kernel_int4(q)
    product = jax.jit(cpu.native_dense_int4, static_argnames=("isa", "x_bits"))
    two_planes = np.asarray(product(x, packed, scale, isa="avx512_vnni", x_bits=16), np.float64)
    one_plane = np.asarray(product(x, packed, scale, isa="avx512_vnni", x_bits=8), np.float64)
    exact = np.asarray(x, np.float64) @ (q * np.repeat(np.asarray(scale, np.float64), 32, axis=0))
    assert np.abs(two_planes - exact).max() < np.abs(one_plane - exact).max() / 10
