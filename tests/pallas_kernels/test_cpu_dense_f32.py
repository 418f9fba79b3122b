# SPDX-License-Identifier: Apache-2.0
"""The float32 dense kernel (`dense_f32.cc`, AVX2 FMA): its packed layout, then the kernel against
NumPy over a grid of shapes (row counts around its 6-row register blocks and row chunks, odd
depths for the one- and two-row blocks that split even and odd k, odd 16-column blocks, a
vocabulary-wide head). Runs of the kernel skip on CPUs without AVX2 and FMA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu
from pallas_kernels.cpu.dense import unpack_dense_kernel
from tests.grids import split_product


@pytest.fixture(scope="module")
def f32_kernels(native_kernels):
    if not cpu.dense_f32_usable(native_kernels):
        pytest.skip("this CPU (or its kernel) has no AVX2 with FMA")
    return native_kernels


def test_packed_layout_puts_each_element_where_the_panels_read_it():
    kernel = jnp.asarray(np.arange(5 * 48, dtype=np.float32).reshape(5, 48))
    packed = np.asarray(cpu.pack_dense_kernel_f32(kernel))
    assert packed.shape == (3, 5, 16)
    for k, n in [(0, 0), (1, 0), (0, 1), (2, 17), (4, 47), (3, 16), (1, 15)]:
        assert packed[n // 16, k, n % 16] == kernel[k, n]  # panel n // 16, row k, column n % 16
    np.testing.assert_array_equal(unpack_dense_kernel(jnp.asarray(packed)), kernel)


@pytest.mark.parametrize(
    ("shape", "dtype"), [((48, 40), jnp.float32), ((64, 32), jnp.bfloat16), ((64,), jnp.float32)]
)
def test_kernels_the_float32_kernel_cannot_take_are_refused_by_name(shape, dtype):
    assert not cpu.can_pack_f32(shape, dtype)
    with pytest.raises(ValueError, match=r"float32 \[K, N\] kernel with N a multiple of 16"):
        cpu.pack_dense_kernel_f32(jnp.zeros(shape, dtype))


def test_hand_worked_product(f32_kernels):
    # x row r is all r + 1 over 3 columns; kernel column n is all n + 1: y[r, n] = 3 (r + 1)(n + 1).
    x = jnp.asarray(np.repeat(np.arange(1, 8, dtype=np.float32)[:, None], 3, axis=1))
    kernel = jnp.asarray(np.tile(np.arange(1, 33, dtype=np.float32), (3, 1)))
    y = jax.jit(cpu.native_dense)(x, cpu.pack_dense_kernel_f32(kernel))
    np.testing.assert_array_equal(y, 3 * np.outer(np.arange(1, 8), np.arange(1, 33)))


# 1-2 rows split even/odd k (odd depths leave one k over); 6-row blocks; rows past a 128 KiB chunk
# of x (56 rows at K = 576).
ROWS = (1, 2, 3, 5, 6, 7, 12, 13, 31, 64, 70)
KERNELS = ((1, 16), (7, 48), (64, 32), (576, 960), (1535, 64))


# The fast tier takes each path once (one and two rows over odd depths, a 6-row block's leftover
# of 5 rows and of 1, rows past a chunk of x) with every kernel shape once; `make test` the whole
# product.
FAST = {(1, (1, 16)), (2, (7, 48)), (5, (576, 960)), (13, (64, 32)), (64, (1535, 64))}


@pytest.mark.parametrize(("rows", "depth", "width"), split_product(ROWS, KERNELS, FAST))
def test_kernel_matches_numpy(f32_kernels, rows, depth, width):
    rng = np.random.default_rng(rows * 7919 + depth + width)
    x = rng.standard_normal((rows, depth)).astype(np.float32)
    kernel = (rng.standard_normal((depth, width)) * depth**-0.5).astype(np.float32)
    got = jax.jit(cpu.native_dense)(jnp.asarray(x), cpu.pack_dense_kernel_f32(jnp.asarray(kernel)))
    assert got.shape == (rows, width) and got.dtype == jnp.float32
    expected = x.astype(np.float64) @ kernel.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5 * np.sqrt(depth))


@pytest.mark.parametrize(("rows", "tail"), [(13, 5), (70, 69)])
def test_trailing_zero_rows_give_zero_rows_and_the_rest_matches_numpy(f32_kernels, rows, tail):
    """Trailing all-zero rows of x (+0 and -0) are skipped: zeros even where the output buffer
    held another product's values; a row zero but for its last value, or with a NaN, is multiplied."""
    rng = np.random.default_rng(rows + tail)
    kernel = (rng.standard_normal((576, 64)) * 576**-0.5).astype(np.float32)
    packed = cpu.pack_dense_kernel_f32(jnp.asarray(kernel))
    base = rng.standard_normal((rows, 576)).astype(np.float32)

    @jax.jit
    def after_another_product(first, x, weights):
        total = cpu.native_dense(first, weights).sum()  # its buffer may serve the second product
        return cpu.native_dense(x * (1 + 0 * total), weights)

    for name, change in [("zero tail", None), ("late value", (-tail + 1, -1)), ("nan", (-1, 7))]:
        x = base.copy()
        x[-tail:] = 0.0
        x[-tail + 1 :: 2] = -0.0
        if change:
            x[change] = np.nan if name == "nan" else 2.0
        got = np.asarray(after_another_product(jnp.asarray(base), jnp.asarray(x), packed))
        expected = x.astype(np.float64) @ kernel.astype(np.float64)
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5 * np.sqrt(576), err_msg=name)
        assert (got[~x.any(axis=1)] == 0).all(), name


def test_kernel_on_a_vocabulary_wide_head_inside_a_larger_program(f32_kernels):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((20, 64)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((64, 49152)) * 0.125, jnp.float32)
    packed = cpu.pack_dense_kernel_f32(kernel)

    @jax.jit
    def head(hidden, weights):
        logits = cpu.native_dense(jnp.tanh(hidden), weights)
        return jnp.argmax(logits, axis=-1), logits

    best, logits = head(x, packed)
    expected = np.tanh(np.asarray(x, np.float64)) @ np.asarray(kernel, np.float64)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(best, np.argmax(expected, axis=-1))


def test_kernel_refuses_a_mismatched_input_and_other_paths(f32_kernels):
    packed = cpu.pack_dense_kernel_f32(jnp.zeros((8, 32), jnp.float32))
    with pytest.raises(ValueError, match=r"x \(4, 9\) does not match a packed float32 kernel \(2, 8, 16\)"):
        cpu.native_dense(jnp.zeros((4, 9), jnp.float32), packed)
    with pytest.raises(ValueError, match="a float32 kernel runs on the avx2 path only, not 'amx'"):
        cpu.native_dense(jnp.zeros((4, 8), jnp.float32), packed, isa="amx")
