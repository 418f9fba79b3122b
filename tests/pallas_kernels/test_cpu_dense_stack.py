# SPDX-License-Identifier: Apache-2.0
"""The native dense kernels given a stack of every layer's packed weights (`[L, ...]`) and a
layer's index (`layer=`): each layer's product equals, bit for bit, the same kernel's on that
layer's weights passed alone, and NumPy's `x @ w` of that layer (every layer differs, so a wrong
offset fails); the compiled program slices or copies no weight out of the stack; and a stack or
index that does not fit is refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import int4, int8
from pallas_kernels import cpu

LAYERS, K, N, ROWS = 3, 64, 48, 5


def _layers(dtype) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [(0.05 * rng.standard_normal((K, N))).astype(dtype) for _ in range(LAYERS)]


def _x() -> jax.Array:
    rows = np.random.default_rng(3).standard_normal((ROWS, K)).astype(np.float32)
    rows[-1] = 0  # a padding row: written as zeros
    return jnp.asarray(rows, jnp.bfloat16)


def _bfloat16():
    kernels = [np.asarray(k) for k in _layers(jnp.bfloat16)]
    return [(cpu.pack_dense_kernel(k),) for k in kernels], [k.astype(np.float32) for k in kernels], {}


def _float32():
    kernels = _layers(np.float32)
    return [(cpu.pack_dense_kernel_f32(k),) for k in kernels], kernels, {}


def _int8(group: int | None):
    def build():
        parts = [int8.quantize(k, group) for k in _layers(np.float32)]
        weights = [np.asarray(int8.dequantize(q, s, jnp.float32)) for q, s in parts]
        return [(cpu.pack_dense_kernel_int8(np.asarray(q)), np.asarray(s)) for q, s in parts], weights, {}

    return build


def _int4(group: int, *, halves: bool = False):
    """Affine int4 weights (offsets beside the scales), or their float16 scales and bases."""

    def build():
        rng, packed, weights = np.random.default_rng(5), [], []
        for kernel in _layers(np.float32):
            q, scale = (np.asarray(a) for a in int4.quantize(kernel, group))
            if halves:  # scales and bases float16 holds exactly, the offsets m = b + 8 s from them
                scale = scale.astype(np.float16).astype(np.float32)
                base = (0.01 * rng.standard_normal(scale.shape)).astype(np.float16).astype(np.float32)
                offset = base + 8 * scale
            else:
                offset = (0.01 * rng.standard_normal(scale.shape)).astype(np.float32)
            weights.append(np.asarray(int4.dequantize_affine(q, scale, offset)))
            scale, offset = cpu.float16_scales(scale, offset) if halves else (scale, offset)
            packed.append((cpu.pack_dense_kernel_int4(q), scale, offset))
        return packed, weights, {"base": halves}

    return build


def _call(operands: tuple, options: dict, layer: int | None):
    x = _x()
    if len(operands) == 1:
        return cpu.native_dense(x, operands[0], layer=layer)
    if len(operands) == 2:
        return cpu.native_dense_int8(x, *operands, layer=layer)
    packed, scale, offset = operands
    if options.get("base"):
        return cpu.native_dense_int4(x, packed, scale, base=offset, layer=layer)
    return cpu.native_dense_int4(x, packed, scale, offset, layer=layer)


FORMATS = {
    "bfloat16": _bfloat16,
    "float32": _float32,
    "int8 per channel": _int8(None),
    "int8 groups of 32": _int8(32),
    "int4 affine, groups of 32": _int4(32),
    "int4 float16 scales and bases": _int4(32, halves=True),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_layer_of_a_stack_is_read_in_place(dense_kernels, name):
    if name == "float32" and "avx2" not in cpu.dense_isas(dense_kernels):
        pytest.skip("the float32 kernel needs AVX2 with FMA")
    per_layer, weights, options = FORMATS[name]()
    stack = tuple(jnp.stack([jnp.asarray(p[i]) for p in per_layer]) for i in range(len(per_layer[0])))
    program = jax.jit(lambda *s: [_call(s, options, i) for i in range(LAYERS)])
    stacked = program(*stack)
    x = np.asarray(_x(), np.float32)
    for i, y in enumerate(stacked):
        alone = jax.jit(lambda *p: _call(p, options, None))(*map(jnp.asarray, per_layer[i]))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(alone))
        np.testing.assert_allclose(np.asarray(y), x @ weights[i], rtol=0.02, atol=0.02)
        assert not np.allclose(np.asarray(y)[:-1], (x @ weights[(i + 1) % LAYERS])[:-1], atol=0.02)
    hlo = program.lower(*stack).compile().as_text()
    assert not [op for op in ("slice(", "copy(", "dynamic-slice(") if op in hlo], hlo


def test_a_layer_outside_the_stack_or_a_single_layer_with_an_index_is_refused(dense_kernels):
    packed = jnp.stack([jnp.asarray(p[0]) for p in _bfloat16()[0]])
    with pytest.raises(ValueError, match=r"layer 3 of a stacked packed kernel needs .* L > 3"):
        cpu.native_dense(_x(), packed, layer=3)
    with pytest.raises(ValueError, match=r"layer 0 of a stacked packed kernel needs .* 5 dimensions"):
        cpu.native_dense(_x(), packed[0], layer=0)
    q, s = int8.quantize(_layers(np.float32)[0])
    packed8 = jnp.stack([jnp.asarray(cpu.pack_dense_kernel_int8(np.asarray(q)))] * 2)
    with pytest.raises(ValueError, match=r"stacked int8 scale"):
        cpu.native_dense_int8(_x(), packed8, jnp.asarray(s), layer=1)
