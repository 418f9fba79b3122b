# SPDX-License-Identifier: Apache-2.0
"""The int8 dense kernel with float16 grouped scales (GGUF Q8_0's own d, `float16_int8_scales`)
on every path the CPU has: equal bit for bit to float32 copies of the same scales and within the
kernel's bounds of NumPy's `x @ (q d)` in float64 (on AMX tiles, of `x @ q d` with `q d` rounded
to bfloat16); layers of a stack read in place; scales
float16 would round refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu
from pallas_kernels.cpu.dense_int8 import fixed_point_error_bound
from tests.pallas_kernels.test_cpu_dense_int8 import amx_rounds_weights, bfloat16_values


def _q8_0_blocks(rng, depth, width, group=32):
    """A Q8_0 tensor as GGUF holds it, `[K, N]`: int8 values q (each group's largest at +-127, as
    llama.cpp writes them) and a float16 d per group of 32 inputs and column."""
    q = rng.integers(-127, 128, (depth, width)).astype(np.int8)
    q[::group] = np.where(rng.random(width) < 0.5, 127, -127).astype(np.int8)
    d = (rng.random((depth // group, width)) * 0.02 + 1e-4).astype(np.float16)
    return q, d


def _check(native_kernels, rows, depth, width, group, x_dtype, seed):
    rng = np.random.default_rng(seed)
    q, d = _q8_0_blocks(rng, depth, width, group)
    scale = d.astype(np.float32)
    np.testing.assert_array_equal(cpu.float16_int8_scales(scale), d)  # the file's own d back, exactly
    packed = jnp.asarray(cpu.pack_dense_kernel_int8(q))
    x = jnp.asarray(rng.standard_normal((rows, depth)), x_dtype)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    weights = q * np.repeat(scale.astype(np.float64), group, axis=0)
    expected = x64 @ weights
    float_rounding = 6e-8 * depth * (np.abs(x64) @ np.abs(weights))  # float32 sums of depth terms
    product = jax.jit(cpu.native_dense_int8, static_argnames="isa")
    for isa in cpu.dense_int8_isas(native_kernels):
        if isa == "avx512_vnni" and x_dtype != jnp.bfloat16:
            continue  # float32 x keeps the float product unless asked
        got = np.asarray(product(x, packed, jnp.asarray(d), isa=isa))
        np.testing.assert_array_equal(got, product(x, packed, jnp.asarray(scale), isa=isa), err_msg=isa)
        allowed = float_rounding + (fixed_point_error_bound(x64, q, scale) if isa == "avx512_vnni" else 0)
        if isa == "amx" and x_dtype == jnp.bfloat16 and amx_rounds_weights(rows, depth, group):
            # on the tiles: each q d rounded to bfloat16 (to nearest even), at most 2^-9 of it
            assert np.all(np.abs(got - x64 @ bfloat16_values(weights)) <= float_rounding), isa
            allowed = float_rounding + 2.0**-9 * (np.abs(x64) @ np.abs(weights))
        assert np.all(np.abs(got - expected) <= allowed), isa


@pytest.mark.parametrize(
    ("rows", "x_dtype"), [(1, jnp.bfloat16), (4, jnp.bfloat16), (20, jnp.bfloat16), (3, jnp.float32)]
)
def test_q8_0_scales_in_float16_match_float32_and_numpy(native_kernels, rows, x_dtype):
    _check(native_kernels, rows, 576, 2048, 32, x_dtype, rows)  # the embedded model's head, narrower


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rows", "depth", "width", "group"), [(1, 128, 16, 4), (2, 960, 4096, 32), (7, 512, 96, 128)]
)
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_float16_scales_over_shapes(native_kernels, rows, depth, width, group, x_dtype):
    _check(native_kernels, rows, depth, width, group, x_dtype, depth + rows)


def test_a_stacked_layer_reads_its_float16_scales_in_place(native_kernels):
    rng = np.random.default_rng(3)
    blocks = [_q8_0_blocks(rng, 64, 32) for _ in range(3)]
    packed = jnp.stack([jnp.asarray(cpu.pack_dense_kernel_int8(q)) for q, _ in blocks])
    halves = jnp.stack([jnp.asarray(d) for _, d in blocks])
    x = jnp.asarray(rng.standard_normal((1, 64)), jnp.bfloat16)
    for layer, (q, d) in enumerate(blocks):
        alone = cpu.native_dense_int8(x, jnp.asarray(cpu.pack_dense_kernel_int8(q)), jnp.asarray(d))
        np.testing.assert_array_equal(cpu.native_dense_int8(x, packed, halves, layer=layer), alone)


def test_scales_float16_would_round_are_refused():
    scale = np.full((2, 16), 0.01, np.float16).astype(np.float32)
    np.testing.assert_array_equal(cpu.float16_int8_scales(scale), np.float16(0.01))
    scale[1, 3] = 0.01  # float32's 0.01: float16 would round it
    with pytest.raises(ValueError, match=r"round 1 of 32 int8 scales.*float32"):
        cpu.float16_int8_scales(scale)


def test_a_q8_0_embedding_requantized_gives_back_its_d():
    """A tied head's copy is quantized from the dequantized table (`quantize_tied_head_int8`), in
    the same groups of 32: each block's scale comes back as its float16 d, and its values as q."""
    from gguf.quants import dequantize, quantize

    from models.int8 import quantize_grouped

    rng = np.random.default_rng(5)
    table = rng.standard_normal((64, 96)).astype(np.float32) * 0.05  # [V, D]: blocks along D
    table[3] = 0  # an all-zero row: Q8_0 writes d = 0, requantized it gets scale 1 and q 0
    raw = quantize(table, 8)  # GGMLQuantizationType.Q8_0
    q, scale = quantize_grouped(dequantize(raw, 8).astype(np.float32).T, 32)
    d = raw.reshape(64, 3, 34)[..., :2].copy().view("<f2")[..., 0]  # [V, D / 32]
    np.testing.assert_array_equal(cpu.float16_int8_scales(scale), np.where(d.T == 0, 1, d.T))
    np.testing.assert_array_equal(q.T, raw.reshape(64, 3, 34)[..., 2:].copy().view(np.int8).reshape(64, 96))


def test_a_packed_tied_head_halves_its_grouped_scales(dense_kernels):
    from flax import nnx

    from models import pack_for_native_dense
    from models.layers import Embedding, HeadCopy

    rng = np.random.default_rng(6)
    q, d = _q8_0_blocks(rng, 96, 64)

    def packed_head(float16_head_scales: bool) -> Embedding:
        embedding = Embedding(64, 96, dtype=jnp.bfloat16)
        embedding.head_kernel, embedding.head_scale = HeadCopy(q), HeadCopy(d.astype(np.float32))
        assert pack_for_native_dense(embedding, float16_head_scales=float16_head_scales) == 1
        return embedding

    halved, kept = packed_head(True), packed_head(False)
    assert isinstance(halved.head_scale, HeadCopy) and halved.head_scale[...].dtype == np.float16
    np.testing.assert_array_equal(halved.head_scale[...], d)
    assert kept.head_scale[...].dtype == np.float32
    x = jnp.asarray(rng.standard_normal((1, 96)), jnp.bfloat16)
    np.testing.assert_array_equal(nnx.jit(Embedding.attend)(halved, x), nnx.jit(Embedding.attend)(kept, x))
