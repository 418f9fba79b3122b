# SPDX-License-Identifier: Apache-2.0
"""RMSNorm, alone and with the residual add before it, as one native call (`rms_norm.cc`): the jnp
reference on hand-worked values, then the native calls against it over both dtypes of x and of
the weight, row counts around the calls' work items, a stacked weight's layer, `(1 + w)`, heads
as leading axes, padding rows, and what they refuse."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu

DTYPES = [jnp.float32, jnp.bfloat16]


def test_reference_on_hand_worked_values():
    # mean of squares (9 + 16) / 2 = 12.5; eps 0.5 makes it 13; each value divided by sqrt(13).
    x = jnp.asarray([[3.0, -4.0]], jnp.float32)
    got = cpu.rms_norm_reference(x, jnp.asarray([2.0, 0.5]), eps=0.5)
    np.testing.assert_allclose(np.asarray(got)[0], [6 / math.sqrt(13), -2 / math.sqrt(13)], rtol=1e-6)
    offset = cpu.rms_norm_reference(x, jnp.asarray([1.0, -1.0]), eps=0.5, unit_offset=True)
    np.testing.assert_allclose(np.asarray(offset)[0], [6 / math.sqrt(13), 0.0], rtol=1e-6)
    stack = jnp.asarray([[9.0, 9.0], [2.0, 0.5]])
    np.testing.assert_array_equal(cpu.rms_norm_reference(x, stack, eps=0.5, layer=1), got)


def test_reference_rounds_the_sum_before_the_norm_on_bfloat16():
    # 256 + 1 is not a bfloat16 value (8 bits of mantissa): the sum rounds to 256 first.
    x = jnp.asarray([[256.0, 0.0]], jnp.bfloat16)
    residual = jnp.asarray([[1.0, 0.0]], jnp.bfloat16)
    normed, total = cpu.add_rms_norm_reference(x, residual, jnp.ones(2), eps=0.0)
    assert float(total[0, 0]) == 256.0 and total.dtype == jnp.bfloat16
    assert float(normed[0, 0]) == float(jnp.asarray(math.sqrt(2), jnp.bfloat16))


def _operands(rows: int, dtype, weight_dtype, *, lead: tuple[int, ...] = ()):
    rng = np.random.default_rng(rows)
    shape = (rows, *lead, 96)
    x = jnp.asarray(rng.normal(size=shape) * 3, dtype)
    residual = jnp.asarray(rng.normal(size=shape), dtype)
    stack = jnp.asarray(rng.normal(size=(3, 96)), weight_dtype)
    return x, residual, stack


def _assert_close(got: jax.Array, want: jax.Array) -> None:
    """Equal up to the order of the float32 sum of squares: float32 values within a few ulp,
    bfloat16 ones one rounding step apart where that order crossed a rounding (rarely)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if want.dtype == jnp.float32:
        np.testing.assert_allclose(got32, want32, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_allclose(got32, want32, rtol=2.0**-7, atol=1e-6)
        assert np.mean(got32 != want32) < 0.01


@pytest.mark.parametrize("rows", [1, 3, 341, 342, 700])  # 341 rows of 96: one work item
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_native_norm_matches_the_reference(native_kernels, rows, dtype, weight_dtype):
    x, _, stack = _operands(rows, dtype, weight_dtype)
    for options in (dict(layer=2), dict(layer=0, unit_offset=True)):
        got = jax.jit(lambda x, w, o=options: cpu.rms_norm(x, w, eps=1e-5, **o))(x, stack)
        _assert_close(got, cpu.rms_norm_reference(x, stack, eps=1e-5, **options))
    plain = cpu.rms_norm(x, stack[1], eps=1e-6)
    _assert_close(plain, cpu.rms_norm_reference(x, stack[1], eps=1e-6))


@pytest.mark.parametrize("rows", [1, 5, 400])
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_add_and_norm_matches_the_reference(native_kernels, rows, dtype):
    x, residual, stack = _operands(rows, dtype, jnp.bfloat16)
    normed, total = jax.jit(lambda x, r, w: cpu.add_rms_norm(x, r, w, eps=1e-5, layer=1))(x, residual, stack)
    want_normed, want_total = cpu.add_rms_norm_reference(x, residual, stack, eps=1e-5, layer=1)
    np.testing.assert_array_equal(np.asarray(total, np.float32), np.asarray(want_total, np.float32))
    assert total.dtype == dtype
    _assert_close(normed, want_normed)


def test_heads_as_leading_axes_norm_each_head(native_kernels):
    x, _, stack = _operands(4, jnp.bfloat16, jnp.bfloat16, lead=(3,))  # [T, heads, H]
    got = cpu.rms_norm(x, stack[0], eps=1e-6)
    _assert_close(got, cpu.rms_norm_reference(x, stack[0], eps=1e-6))
    one_head = cpu.rms_norm(x[:, 1], stack[0], eps=1e-6)
    np.testing.assert_array_equal(np.asarray(got[:, 1], np.float32), np.asarray(one_head, np.float32))


def test_zero_rows_stay_zero_and_nan_stays_in_its_row(native_kernels):
    x = np.zeros((4, 96), np.float32)
    x[0] = 1.0
    x[1, 7] = np.nan
    got = np.asarray(cpu.rms_norm(jnp.asarray(x), jnp.full((96,), 2.0), eps=1e-6))
    np.testing.assert_allclose(got[0], 2.0, rtol=1e-5)
    assert np.isnan(got[1]).all()
    np.testing.assert_array_equal(got[2:], 0.0)  # a step's padding rows: written as zeros


def test_refuses_what_it_cannot_take(native_kernels):
    w = jnp.ones((8,))
    with pytest.raises(ValueError, match="float32 or bfloat16 x"):
        cpu.rms_norm(jnp.zeros((2, 8), jnp.float16), w, eps=1e-6)
    with pytest.raises(ValueError, match="weight float32 \\(7,\\)"):
        cpu.rms_norm(jnp.zeros((2, 8)), jnp.ones((7,)), eps=1e-6)
    with pytest.raises(ValueError, match="layer 3"):
        cpu.rms_norm(jnp.zeros((2, 8)), jnp.ones((3, 8)), eps=1e-6, layer=3)
    with pytest.raises(ValueError, match="layer None"):
        cpu.rms_norm(jnp.zeros((2, 8)), jnp.ones((3, 8)), eps=1e-6)
    with pytest.raises(ValueError, match="residual of x's shape and dtype"):
        cpu.add_rms_norm(jnp.zeros((2, 8)), jnp.zeros((2, 8), jnp.bfloat16), w, eps=1e-6)
