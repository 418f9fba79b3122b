# SPDX-License-Identifier: Apache-2.0
"""The int4 dense kernel with float16 scales and bases (`float16_scales`): GGUF Q4_1 blocks' own d
and minimum (Q4_0's d alone) on every path the CPU has, equal bit for bit to the float32 scales
and offsets they come from and within the kernel's bounds of NumPy's `x @ (u d + minimum)` in
float64; scales and bases float16 would round refused by name; a packed Linear halved so."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import pack_for_native_dense
from models.linear import Int4Bases, Linear
from pallas_kernels import cpu
from pallas_kernels.cpu.dense_int4 import fixed_point_error_bound

_FIXED_POINT = {"avx2": 8, "avx512_bf16": 8, "amx": 8, "avx512_vnni": 16}  # rows x is rounded to 16 bits for


def _q4_1_blocks(rng, depth, width, group=32):
    """A Q4_1 tensor as GGUF holds it: unsigned values u, float16 d and minimum per group; and
    the float32 scale and offset `models.gguf_reader` makes of them (m = minimum + 8 d)."""
    u = rng.integers(0, 16, (depth, width))
    d = (rng.random((depth // group, width)) * 0.02 + 1e-3).astype(np.float16)
    minimum = (-rng.random((depth // group, width)) * 0.2).astype(np.float16)
    scale = d.astype(np.float32)
    offset = (minimum.astype(np.float32) + 8 * scale).astype(np.float32)
    return u, d, minimum, scale, offset


@pytest.mark.parametrize("rows", [1, 9, 20])
def test_q4_1_blocks_in_float16_match_float32_and_numpy(native_kernels, rows):
    isas = cpu.dense_int4_isas(native_kernels)
    rng = np.random.default_rng(rows)
    depth, width, group = 576, 1536, 32  # the embedded model's gate/up projection
    u, d, minimum, scale, offset = _q4_1_blocks(rng, depth, width, group)
    half, base = cpu.float16_scales(scale, offset)
    np.testing.assert_array_equal(half, d)  # the file's own d and minimum, back exactly
    np.testing.assert_array_equal(base, minimum)
    packed = jnp.asarray(cpu.pack_dense_kernel_int4((u - 8).astype(np.int8)))
    x = jnp.asarray(rng.standard_normal((rows, depth)), jnp.bfloat16)
    per_k = lambda values: np.repeat(values.astype(np.float64), group, axis=0)  # noqa: E731
    weights = u * per_k(d) + per_k(minimum)  # the file's weights, in float64
    expected = np.asarray(x, np.float64) @ weights
    terms = np.abs(np.asarray(x, np.float64)) @ (u * per_k(d) + np.abs(per_k(minimum)))
    product = jax.jit(cpu.native_dense_int4, static_argnames="isa")
    for isa in isas:
        got = np.asarray(product(x, packed, jnp.asarray(half), base=jnp.asarray(base), isa=isa))
        as_float32 = product(x, packed, jnp.asarray(scale), jnp.asarray(offset), isa=isa)
        np.testing.assert_array_equal(got, as_float32)
        allowed = 4e-7 * (group + depth // group) * terms + 1e-30
        if rows <= _FIXED_POINT.get(isa, 0):
            allowed = allowed + fixed_point_error_bound(x, u - 8, scale)
        elif isa in ("avx512_bf16", "amx", "avx512_vnni") and "avx512_bf16" in isas:  # weights in bfloat16
            allowed = allowed + 2.0**-8 * (np.abs(np.asarray(x, np.float64)) @ np.abs(weights))
        assert np.all(np.abs(got - expected) <= allowed), isa
    reference = cpu.native_dense_int4_reference(x, packed, jnp.asarray(half), base=jnp.asarray(base))
    np.testing.assert_allclose(reference, expected, rtol=1e-5, atol=1e-5 * np.sqrt(depth))


@pytest.mark.parametrize("rows", [2, 20])  # 20: panels widened to bfloat16 from the float16 scales
def test_q4_0_scales_alone_in_float16(native_kernels, rows):
    """Q4_0: `w = d (u - 8)`, d float16 and no offset; the kernel's base is -8 d."""
    rng = np.random.default_rng(7)
    u, d, _, scale, _ = _q4_1_blocks(rng, 96, 32)
    packed = cpu.pack_dense_kernel_int4((u - 8).astype(np.int8))
    x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.bfloat16)
    product = jax.jit(cpu.native_dense_int4, static_argnames="isa")
    for isa in cpu.dense_int4_isas(native_kernels):
        np.testing.assert_array_equal(
            product(x, packed, jnp.asarray(d), isa=isa), product(x, packed, jnp.asarray(scale), isa=isa)
        )


def test_scales_and_bases_float16_would_round_are_refused():
    rng = np.random.default_rng(8)
    _, _, _, scale, offset = _q4_1_blocks(rng, 64, 16)
    with pytest.raises(ValueError, match=r"round 1 of 32 int4 scales.*float32"):
        cpu.float16_scales(np.where(np.arange(32).reshape(2, 16) == 5, np.float32(1 + 2**-20), scale), offset)
    zero_points = rng.integers(0, 16, scale.shape).astype(np.float32)  # AWQ: m = (8 - z) s
    with pytest.raises(ValueError, match=r"bases"):
        cpu.float16_scales(scale, (8 - zero_points) * scale * np.float32(1 + 2**-12))
    with pytest.raises(ValueError, match="not both"):
        packed = jnp.zeros((1, 8, 16), jnp.uint32)
        cpu.native_dense_int4(jnp.ones((1, 64)), packed, scale, offset, base=offset)


def test_a_packed_q4_1_linear_halves_its_scales(dense_kernels):
    rng = np.random.default_rng(9)
    u, d, minimum, scale, offset = _q4_1_blocks(rng, 96, 32)

    def packed_linear(float16_scales: bool) -> Linear:
        linear = Linear(96, 32, bias=False, dtype=jnp.bfloat16)
        linear.kernel = nnx.Param(np.asarray(u - 8, np.int8))
        linear.kernel_scale, linear.kernel_offset = nnx.Param(scale), nnx.Param(offset)
        assert pack_for_native_dense(linear, int4=True, float16_scales=float16_scales) == 1
        return linear

    halved = packed_linear(float16_scales=True)
    assert isinstance(halved.kernel_offset, Int4Bases) and halved.kernel_offset[...].dtype == np.float16
    np.testing.assert_array_equal(halved.kernel_scale[...], d)
    np.testing.assert_array_equal(halved.kernel_offset[...], minimum)
    x = jnp.asarray(rng.standard_normal((1, 96)), jnp.bfloat16)
    np.testing.assert_array_equal(halved.product(x), packed_linear(float16_scales=False).product(x))
