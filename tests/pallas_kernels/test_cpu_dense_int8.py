# SPDX-License-Identifier: Apache-2.0
"""The int8-weight dense kernel (`dense_int8.cc`, AVX-512 BF16, AVX-512 and AVX2): its packed
layout, a hand-worked product, then every path the CPU has against NumPy's `x @ (q * s)` over a
grid of shapes (1 to 130 rows around its 6-row register blocks, the rows from which AVX-512 BF16
widens panels ahead and the chunks of rows that reuse them; odd depths for the one-row blocks that
split even and odd k and for the register path that takes them; 16-column counts around the
4-block AVX-512 register blocks), bfloat16 and float32 activations; trailing zero rows; and a tiny
model with its int8 kernels packed for the native kernel against the same model on XLA's int8
dots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import load_model, pack_for_native_dense
from models.linear import Linear, PackedKernel
from models.loader import put_on_device
from models.quantization import quantize_int8
from pallas_kernels import cpu
from pallas_kernels.cpu.dense_int8 import unpack_dense_kernel_int8
from tests.models.tiny_checkpoints import caches, prompts, run_step, save_tiny


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


def test_hand_worked_product(int8_isas):
    # x row r is all r + 1 over 3 columns; q column n is all n - 16, scale n + 1:
    # y[r, n] = 3 (r + 1)(n - 16)(n + 1).
    x = jnp.asarray(np.repeat(np.arange(1, 8, dtype=np.float32)[:, None], 3, axis=1), jnp.bfloat16)
    q = np.tile(np.arange(-16, 16, dtype=np.int8), (3, 1))
    scale = jnp.arange(1, 33, dtype=jnp.float32)
    packed = cpu.pack_dense_kernel_int8(q)
    for isa in int8_isas:
        y = jax.jit(cpu.native_dense_int8, static_argnames="isa")(x, packed, scale, isa=isa)
        expected = 3 * np.outer(np.arange(1, 8), np.arange(-16, 16) * np.arange(1, 33))
        np.testing.assert_array_equal(y, expected)


ROWS = (1, 2, 3, 5, 6, 7, 8, 9, 13, 31, 64, 130)
KERNELS = ((1, 16), (7, 48), (33, 80), (96, 112), (576, 960), (1535, 64), (1536, 48))


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("depth", "width"), KERNELS)
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
    for isa in int8_isas:
        got = jax.jit(cpu.native_dense_int8, static_argnames="isa")(x, packed, jnp.asarray(scale), isa=isa)
        assert got.shape == (rows, width) and got.dtype == jnp.float32
        # float32 accumulation: an error below depth ulps of the sum of |products|
        assert np.all(np.abs(np.asarray(got, np.float64) - expected) <= 2e-7 * depth * bound + 1e-30), isa
    reference = cpu.native_dense_int8_reference(x, packed, jnp.asarray(scale))
    np.testing.assert_allclose(reference, expected, rtol=1e-5, atol=1e-5 * np.sqrt(depth))


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
    expected = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) @ (q * np.asarray(scale, np.float64))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(got)[5:], 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
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
