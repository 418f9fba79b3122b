# SPDX-License-Identifier: Apache-2.0
"""The bfloat16 dense kernel (C++ through XLA FFI): its packed layout, its reference, and each of
its paths (AMX tiles, AVX-512 BF16 vectors, AVX2 FMA) against the reference over a grid of shapes
(row counts around the 16-row tiles, the 6- and 4-row register blocks and AVX2's switch to panels
widened once for more than 8 rows, odd 16-column blocks, deep and wide kernels, a deep single panel
over several chunks of rows).
Runs of a path skip on CPUs without its instructions."""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu
from tests.grids import split_product


@pytest.fixture(params=["amx", "avx512_bf16", "avx2"])
def isa(request, dense_kernels) -> str:
    """Each path of the dense kernel this CPU runs."""
    if request.param not in cpu.dense_isas(dense_kernels):
        pytest.skip(f"this CPU (or its kernel) does not run the {request.param} path")
    return request.param


def _bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def test_packed_layout_puts_each_element_where_the_tiles_read_it():
    kernel = jnp.asarray(np.arange(64 * 48).reshape(64, 48), jnp.float32).astype(jnp.bfloat16)
    packed = np.asarray(cpu.pack_dense_kernel(kernel).astype(jnp.float32))
    assert packed.shape == (3, 32, 16, 2)
    source = np.asarray(kernel.astype(jnp.float32))
    for k, n in [(0, 0), (1, 0), (0, 1), (2, 17), (63, 47), (31, 16), (33, 15)]:
        # Column block n // 16, row pair k // 2, column n % 16, member k % 2 of the pair.
        assert packed[n // 16, k // 2, n % 16, k % 2] == source[k, n]
    np.testing.assert_array_equal(cpu.dense.unpack_dense_kernel(jnp.asarray(packed)), source)


def test_reference_on_a_hand_worked_product():
    # x row r is all r + 1; kernel column n is all (n + 1) / 64 over the 32 rows:
    # y[r, n] = 32 * (r + 1) * (n + 1) / 64 = (r + 1) * (n + 1) / 2, exact in bfloat16/float32.
    x = jnp.asarray(np.repeat(np.arange(1, 4, dtype=np.float32)[:, None], 32, axis=1), jnp.bfloat16)
    kernel = jnp.asarray(np.tile(np.arange(1, 17, dtype=np.float32) / 64, (32, 1)), jnp.bfloat16)
    y = cpu.native_dense_reference(x, cpu.pack_dense_kernel(kernel))
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, np.outer(np.arange(1, 4), np.arange(1, 17)) / 2)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((48, 16), jnp.bfloat16), ((64, 40), jnp.bfloat16), ((64, 32), jnp.float32), ((64,), jnp.bfloat16)],
)
def test_kernels_the_native_kernel_cannot_take_are_refused_by_name(shape, dtype):
    assert not cpu.can_pack(shape, dtype)
    with pytest.raises(ValueError, match=r"bfloat16 \[K, N\] kernel with K a multiple of 32 and N of 16"):
        cpu.pack_dense_kernel(jnp.zeros(shape, dtype))


# 64 and up cross the vector path's row chunks at K = 1536 (42 rows), 130 at K = 576 (108 rows); 31 and
# up cross the widened AVX2 path's (float32 x: 18 rows at K = 1536, 54 at K = 576).
ROWS = (1, 2, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 70, 130)
KERNELS = ((32, 16), (64, 48), (576, 960), (1536, 64), (1536, 16))


# The fast tier takes each path's row cases once (one and two rows, a 4-row block and one over,
# AVX2's widened panels past 8 rows, a 16-row tile and one over, the row chunks at K = 1536) with
# every kernel shape once; `make test` the whole product.
FAST = {(1, (32, 16)), (2, (64, 48)), (5, (1536, 64)), (9, (576, 960)), (17, (32, 16)), (64, (1536, 16))}


@pytest.mark.parametrize(("rows", "depth", "width"), split_product(ROWS, KERNELS, FAST))
def test_kernel_matches_reference(isa, rows, depth, width):
    rng = np.random.default_rng(rows * 7919 + depth + width)
    x, kernel = _bf16(rng, (rows, depth)), _bf16(rng, (depth, width), scale=depth**-0.5)
    packed = cpu.pack_dense_kernel(kernel)
    got = jax.jit(functools.partial(cpu.native_dense, isa=isa))(x, packed)
    assert got.shape == (rows, width) and got.dtype == jnp.float32
    # Same float32 accumulation of exact bfloat16 products; only the summation order differs.
    np.testing.assert_allclose(got, cpu.native_dense_reference(x, packed), rtol=1e-5, atol=1e-5)


def _with_zero_tail(x: np.ndarray, tail: int) -> np.ndarray:
    """`x` with an interior zero row, and its last `tail` rows zero (+0 and -0 alternating)."""
    x = x.copy()
    x[1] = 0.0
    x[-tail:] = 0.0
    x[-tail + 1 :: 2] = -0.0
    return x


@pytest.mark.parametrize(("rows", "tail"), [(20, 7), (64, 40), (130, 129)])
def test_trailing_zero_rows_give_zero_rows_and_the_rest_matches_reference(isa, rows, tail):
    """The kernel skips trailing all-zero rows of x (a step's padding): their output rows are
    zeros even where the output buffer held another product's values, a row that is zero but for
    its last value or holds a NaN is still multiplied, and every other row matches the reference."""
    rng = np.random.default_rng(rows + tail)
    kernel = _bf16(rng, (576, 960), scale=576**-0.5)
    packed = cpu.pack_dense_kernel(kernel)
    base = np.asarray(_bf16(rng, (rows, 576)).astype(jnp.float32))
    cases = {"zero tail": _with_zero_tail(base, tail), "all zero": np.zeros_like(base)}
    late = _with_zero_tail(base, tail)
    late[-tail + 2, -1] = 1.5  # the tail's third row: zero but for its last value
    cases["late value"] = late
    nan = _with_zero_tail(base, tail)
    nan[-1, 100] = np.nan
    cases["nan"] = nan

    @jax.jit
    def after_another_product(first, x, weights):
        # The first product's buffer is free once it is summed: XLA may hand it to the second.
        total = cpu.native_dense(first, weights, isa=isa).sum()
        return cpu.native_dense(x * (1 + 0 * total).astype(x.dtype), weights, isa=isa)

    for name, x in cases.items():
        x = jnp.asarray(x, jnp.bfloat16)
        got = after_another_product(jnp.asarray(base, jnp.bfloat16), x, packed)
        expected = cpu.native_dense_reference(x, packed)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=name)
        zero_rows = ~np.asarray(x, np.float32).any(axis=1)  # (NaN counts as non-zero)
        assert (np.asarray(got)[zero_rows] == 0).all(), name


def test_kernel_on_a_vocabulary_wide_head_and_inside_a_larger_program(isa):
    rng = np.random.default_rng(3)
    x, kernel = _bf16(rng, (20, 64)), _bf16(rng, (64, 49152), scale=0.125)
    packed = cpu.pack_dense_kernel(kernel)

    @jax.jit
    def head(hidden, weights):
        logits = cpu.native_dense(jnp.tanh(hidden.astype(jnp.float32)).astype(jnp.bfloat16), weights, isa=isa)
        return jnp.argmax(logits, axis=-1), logits

    best, logits = head(x, packed)
    expected = cpu.native_dense_reference(jnp.tanh(x.astype(jnp.float32)).astype(jnp.bfloat16), packed)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(best, np.argmax(expected, axis=-1))


def test_kernel_refuses_an_input_that_does_not_match_the_packed_kernel(dense_kernels):
    packed = cpu.pack_dense_kernel(jnp.zeros((64, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x \(4, 32\) does not match a packed kernel \(2, 32, 16, 2\)"):
        cpu.native_dense(jnp.zeros((4, 32), jnp.bfloat16), packed)
    names = r"\['amx', 'avx2', 'avx512_bf16'\]"
    with pytest.raises(ValueError, match=rf"isa must be one of {names} or None, not 'sse'"):
        cpu.native_dense(jnp.zeros((4, 64), jnp.bfloat16), packed, isa="sse")


def test_default_path_is_the_best_one_the_cpu_runs(dense_kernels):
    isas = cpu.dense_isas(dense_kernels)
    assert cpu.dense_isa(dense_kernels) == isas[0]
    assert set(isas) <= {"amx", "avx512_bf16", "avx2"}
    flags = pathlib.Path("/proc/cpuinfo").read_text()
    assert ("avx512_bf16" in isas) == (" avx512_bf16" in flags)
    assert ("avx2" in isas) == (" avx2" in flags and " fma" in flags)
