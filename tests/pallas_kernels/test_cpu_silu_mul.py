# SPDX-License-Identifier: Apache-2.0
"""SwiGLU's `silu(gate) * up` as one native call (`silu_mul.cc`): the jnp reference on hand-worked
values, then the native call against it over row counts around its 8-row items and both output
dtypes, its padding rows, and what it refuses."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu


def _silu(x: float) -> float:
    return x / (1 + math.exp(-x))


def test_reference_on_hand_worked_values():
    gate = [0.0, 1.0, -1.0, 20.0, -20.0]
    up = [5.0, 2.0, 3.0, 0.5, 1.0]
    got = cpu.silu_and_mul_reference(jnp.asarray([gate + up], jnp.float32), dtype=jnp.float32)
    want = [0.0, 2 * 0.7310585786, 3 * -0.2689414214, 0.5 * 19.99999999587769, -4.122307e-08]
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-6)


def test_reference_rounds_like_pytorch_on_bfloat16():
    # gate 1 + 2^-9 rounds to 1 first; silu(1) = 0.73106 rounds to 0.73046875; times up 3.
    x = jnp.asarray([[1 + 2.0**-9, 3.0]], jnp.float32)
    got = cpu.silu_and_mul_reference(x, dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    assert float(got[0, 0]) == float(jnp.asarray(0.73046875 * 3, jnp.bfloat16))


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 64, 131])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_call_matches_the_reference(native_kernels, rows, dtype):
    rng = np.random.default_rng(rows)
    width = 96
    x = jnp.asarray(rng.normal(size=(rows, 2 * width)) * 4, jnp.float32)
    got = np.asarray(cpu.silu_and_mul(x, dtype=dtype), np.float32)
    want = np.asarray(cpu.silu_and_mul_reference(x, dtype=dtype), np.float32)
    assert got.shape == (rows, width)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, rtol=4 * eps, atol=4 * eps * np.abs(want).max())
    if dtype == jnp.bfloat16:  # silu in float32 within a few ulp: rarely across a bfloat16 rounding
        assert np.mean(got != want) < 0.01
    expected = np.array(
        [_silu(g) * u for g, u in zip(np.asarray(x)[0, :width], np.asarray(x)[0, width:], strict=True)]
    )
    np.testing.assert_allclose(got[0], expected, rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5, atol=1e-5)


def test_trailing_zero_rows_give_zeros_and_other_rows_are_computed(native_kernels):
    x = np.zeros((12, 8), np.float32)  # gate columns 0..3, up 4..7
    x[0] = 1.0
    x[2, 5] = np.nan  # a NaN row propagates
    x[3] = -0.0  # a zero row inside the rows computed
    x[5, [0, 4]] = 1.0, 2.0  # the last row before the zero tail
    out = np.asarray(cpu.silu_and_mul(jnp.asarray(x), dtype=jnp.bfloat16), np.float32)
    np.testing.assert_allclose(out[0], _silu(1.0), rtol=1e-2)
    assert np.isnan(out[2, 1]) and not np.isnan(out[2, 0])
    np.testing.assert_array_equal(out[3:5], 0.0)
    np.testing.assert_allclose(out[5], [2 * _silu(1.0), 0, 0, 0], rtol=1e-2)
    np.testing.assert_array_equal(out[6:], 0.0)  # written, not left as the buffer held them


def test_refuses_what_it_cannot_take(native_kernels):
    with pytest.raises(ValueError, match="float32 \\[T, 2I\\] products"):
        cpu.silu_and_mul(jnp.zeros((2, 8), jnp.bfloat16), dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="to float16"):
        cpu.silu_and_mul(jnp.zeros((2, 8), jnp.float32), dtype=jnp.float16)
    with pytest.raises(ValueError, match="\\(2, 7\\)"):
        cpu.silu_and_mul(jnp.zeros((2, 7), jnp.float32), dtype=jnp.float32)
