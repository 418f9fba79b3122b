# SPDX-License-Identifier: Apache-2.0
"""int8 weights (W8A16): quantization against NumPy, the int8 products against float references,
every architecture's int8 model against the float model holding the dequantized weights, and
trained tiny models' teacher-forced choices against their float originals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import load_model
from models.int8 import (
    checkpoint_scale,
    dequantize,
    group_size,
    int8_dot_dequantized,
    int8_dot_on_gpu,
    int8_dot_per_group,
    quantize_grouped,
    quantize_per_channel,
)
from models.linear import Linear, matmul
from models.loader import put_on_device
from models.moe import SparseMoE, StackedLinear
from models.quantization import quantize_int8
from tests.models.tiny_checkpoints import ARCHS, caches, prompts, run_step, save_tiny
from tests.models.trained_tiny import save_trained_tiny, teacher_forced_logits, text_ids


def _numpy_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The definition, column by column, in float64."""
    w = w.astype(np.float64)
    q = np.zeros(w.shape, np.int8)
    s = np.zeros(w.shape[:-2] + w.shape[-1:])
    for index in np.ndindex(*w.shape[:-2], w.shape[-1]):
        column = w[(*index[:-1], slice(None), index[-1])]
        amax = np.abs(column).max()
        scale = amax / 127 if amax > 0 else 1.0
        s[index] = scale
        q[(*index[:-1], slice(None), index[-1])] = np.clip(np.rint(column / scale), -127, 127)
    return q, s


def test_hand_worked_column():
    # Column max |w| = 2.54 -> scale 0.02; 1.0 / 0.02 = 50; -2.54 -> -127; 0.011 / 0.02 = 0.55 -> 1.
    w = np.array([[1.0, 0.0], [-2.54, 0.0], [0.011, 0.0]], np.float32)
    q, s = quantize_per_channel(w)
    np.testing.assert_allclose(s, [0.02, 1.0], rtol=1e-6)  # an all-zero column: scale 1
    assert q[:, 0].tolist() == [50, -127, 1] and q[:, 1].tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((64, 96), np.float32),  # a Linear's [in, out]
        ((64, 96), jnp.bfloat16),
        ((4, 32, 48), np.float32),  # MoE experts' [E, in, out]
        ((576, 1536), jnp.bfloat16),  # an embedded-model MLP kernel's shape
    ],
)
def test_quantize_matches_numpy_and_error_is_half_a_step(shape, dtype):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 2.0, shape[-1])).astype(dtype)
    q, s = quantize_per_channel(w)
    expected_q, expected_s = _numpy_quantize(np.asarray(w, np.float32))
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == shape[:-2] + shape[-1:]
    np.testing.assert_allclose(s, expected_s, rtol=1e-6)
    # float32 division may round a value sitting on .5 the other way: at most one step, rarely.
    assert np.abs(q.astype(int) - expected_q).max() <= 1
    assert (q != expected_q).mean() < 1e-3
    assert np.abs(q).max() == 127 and q.min() >= -127
    error = np.abs(dequantize(q, s) - np.asarray(w, np.float32))
    assert np.all(error <= s[..., None, :] * 0.5 * (1 + 1e-5))  # half a step, each column's own
    # The same function on device arrays (the abstract and in-program path): XLA may divide by
    # 127 as a multiply by its inverse, one float32 rounding apart.
    jq, js = quantize_per_channel(jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(js), s, rtol=1e-6)
    assert np.abs(np.asarray(jq).astype(int) - q).max() <= 1


def test_checkpoint_scales_per_channel_per_tensor_and_grouped():
    np.testing.assert_array_equal(checkpoint_scale(np.array([[0.5], [0.25]]), (2,)), [0.5, 0.25])
    np.testing.assert_array_equal(checkpoint_scale(np.array([0.5]), (3,)), [0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="per output channel"):
        checkpoint_scale(np.ones((4, 1)), (3,))
    # Grouped: the HF orientation `[out, in / G]` -> ours `[in / G, out]`.
    hf = np.array([[0.5, 0.25, 0.125], [1.0, 2.0, 4.0]], np.float16)
    np.testing.assert_array_equal(checkpoint_scale(hf, (3, 2)), [[0.5, 1.0], [0.25, 2.0], [0.125, 4.0]])
    with pytest.raises(ValueError, match="per group of inputs"):
        checkpoint_scale(hf, (2, 3))


def _numpy_quantize_grouped(w: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The grouped definition, group by group of `size` inputs of each column, in float64."""
    w = w.astype(np.float64)
    q = np.zeros(w.shape, np.int8)
    s = np.zeros((w.shape[0] // size, w.shape[1]))
    for g, col in np.ndindex(*s.shape):
        block = w[g * size : (g + 1) * size, col]
        amax = np.abs(block).max()
        s[g, col] = amax / 127 if amax > 0 else 1.0
        q[g * size : (g + 1) * size, col] = np.clip(np.rint(block / s[g, col]), -127, 127)
    return q, s


def test_grouped_hand_worked_column():
    # Groups of 2 inputs: [1.0, -2.54] -> scale 0.02, q [50, -127]; [0.0, 0.0] -> scale 1, q 0;
    # [0.3, 0.011] -> scale 0.3/127, q [127, round(4.656...)] = 5.
    w = np.array([[1.0], [-2.54], [0.0], [0.0], [0.3], [0.011]], np.float32)
    q, s = quantize_grouped(w, 2)
    assert s.shape == (3, 1) and group_size(q.shape, s.shape) == 2
    np.testing.assert_allclose(s[:, 0], [0.02, 1.0, 0.3 / 127], rtol=1e-6)
    assert q[:, 0].tolist() == [50, -127, 0, 0, 127, 5]
    np.testing.assert_allclose(dequantize(q, s)[:, 0], [1.0, -2.54, 0, 0, 0.3, 5 * 0.3 / 127], rtol=1e-6)


@pytest.mark.parametrize(("shape", "size"), [((64, 48), 32), ((96, 80), 16), ((256, 32), 128)])
def test_grouped_quantize_matches_numpy_and_error_is_half_its_groups_step(shape, size):
    rng = np.random.default_rng(size)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 2.0, (shape[0], 1))).astype(np.float32)
    q, s = quantize_grouped(w, size)
    expected_q, expected_s = _numpy_quantize_grouped(w, size)
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (shape[0] // size, shape[1])
    np.testing.assert_allclose(s, expected_s, rtol=1e-6)
    assert np.abs(q.astype(int) - expected_q).max() <= 1 and (q != expected_q).mean() < 1e-3
    error = np.abs(dequantize(q, s) - w)
    assert np.all(error <= np.repeat(s, size, axis=0) * 0.5 * (1 + 1e-5))
    # Device arrays alike (the abstract path), and the dequantization too.
    _, js = quantize_grouped(jnp.asarray(w), size)
    np.testing.assert_allclose(np.asarray(js), s, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(dequantize(jnp.asarray(q), jnp.asarray(s))), dequantize(q, s))
    with pytest.raises(ValueError, match="groups of 7"):
        quantize_grouped(w, 7)
    with pytest.raises(ValueError, match="fits no kernel"):
        group_size((64, 48), (3, 48))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("path", ["matmul", "per_group", "dequantized", "on_gpu"])
def test_grouped_int8_matmul_matches_float_reference(dtype, tokens, path):
    """`matmul` (and so every Linear) on a grouped int8 kernel, and each platform's formulation
    of it (`int8_dot`: a dot batched over the groups on TPU, on GPU that or (from 17 bfloat16
    tokens) the weight dequantized to bfloat16, the float32 dequantized weight on CPU) against
    float64 NumPy on the dequantized weights. The accelerators' products come rounded to x's
    dtype (bfloat16: a relative 2^-8 of the largest possible value at most), the CPU's not."""
    rounded = dtype == jnp.bfloat16 and path in ("per_group", "on_gpu")
    tol = 2.0**-7 if rounded else 1e-5
    rng = np.random.default_rng(tokens)
    w = rng.standard_normal((128, 80)).astype(np.float32) * rng.uniform(0.01, 2.0, (128, 1)).astype(
        np.float32
    )
    q, s = quantize_grouped(w, 32)
    x = jnp.asarray(rng.standard_normal((tokens, 128)), dtype)
    products = {
        "matmul": lambda x, q, s: matmul(x, nnx.Param(q), nnx.Param(s)),
        "per_group": int8_dot_per_group,
        "dequantized": int8_dot_dequantized,
        "on_gpu": int8_dot_on_gpu,
    }
    got = jax.jit(products[path])(x, q, s)
    expected = np.asarray(x, np.float64) @ dequantize(q, s).astype(np.float64)
    assert got.dtype == jnp.float32 and got.shape == (tokens, 80)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(dequantize(q, s).astype(np.float64))
    assert np.all(np.abs(np.asarray(got) - expected) <= tol * scale + 1e-6)


def test_fused_grouped_parts_keep_their_scales_and_refuse_mixed_layouts():
    rng = np.random.default_rng(0)
    parts = []
    for out in (32, 16, 16):
        linear = Linear(64, out, bias=False, dtype=jnp.float32)
        q, s = quantize_grouped(rng.standard_normal((64, out)).astype(np.float32), 32)
        linear.kernel, linear.kernel_scale = nnx.Param(q), nnx.Param(s)
        parts.append(linear)
    fused = Linear.concatenated(parts, blocks=2)
    assert fused.kernel_scale[...].shape == (2, 64)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    halves = [np.split(np.asarray(p(x)), 2, axis=1) for p in parts]
    expected = np.concatenate([h[j] for j in range(2) for h in halves], axis=1)  # interleaved blocks
    np.testing.assert_allclose(np.asarray(fused(x)), expected, rtol=1e-5, atol=1e-5)  # float32 sums
    float_part = Linear(64, 16, bias=False, dtype=jnp.float32)
    float_part.kernel.set_value(rng.standard_normal((64, 16)).astype(np.float32))
    mixed = Linear.concatenated([parts[0], float_part])  # quantized in the int8 parts' groups
    assert mixed.kernel_scale[...].shape == (2, 48)
    per_channel = Linear(64, 16, bias=False, dtype=jnp.float32)
    q, s = quantize_per_channel(rng.standard_normal((64, 16)).astype(np.float32))
    per_channel.kernel, per_channel.kernel_scale = nnx.Param(q), nnx.Param(s)
    with pytest.raises(ValueError, match="different layouts"):
        Linear.concatenated([parts[0], per_channel])


# The int8 product against float64 NumPy on the dequantized weights: float32 activations carry
# only float32 rounding; bfloat16 activations are rounded to bfloat16 first in both (the products
# then accumulate in float32: relative error around 2^-9 of the row's magnitude).
@pytest.mark.parametrize(("dtype", "tol"), [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-5)])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_int8_matmul_matches_float_reference(dtype, tol, tokens):
    rng = np.random.default_rng(tokens)
    w = rng.standard_normal((128, 80)).astype(np.float32)
    q, s = quantize_per_channel(w)
    x = jnp.asarray(rng.standard_normal((tokens, 128)), dtype)
    got = jax.jit(lambda x, q, s: matmul(x, nnx.Param(q), nnx.Param(s)))(x, q, s)
    expected = np.asarray(x, np.float64) @ dequantize(q, s).astype(np.float64)
    assert got.dtype == jnp.float32
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(dequantize(q, s).astype(np.float64))
    assert np.all(np.abs(np.asarray(got) - expected) <= tol * scale + 1e-6)


def test_int8_program_carries_int8_weights():
    """The step program takes the int8 array itself: the weights cross memory as int8."""
    q, s = quantize_per_channel(np.ones((64, 32), np.float32))
    text = (
        jax.jit(lambda x, q, s: matmul(x, nnx.Param(q), nnx.Param(s)))
        .lower(jnp.ones((4, 64), jnp.bfloat16), q, s)
        .as_text()
    )
    assert "tensor<64x32xi8>" in text


def _dequantized_copy(model: nnx.Module) -> None:
    """Replaces every int8 kernel of `model` by its float32 dequantization (the float model
    the int8 one must equal)."""
    for _, module in list(nnx.iter_modules(model)):
        scale = getattr(module, "kernel_scale", None)
        if scale is not None:
            module.kernel = nnx.Param(dequantize(np.asarray(module.kernel[...]), np.asarray(scale[...])))
            module.kernel_scale = None
        head_scale = getattr(module, "head_scale", None)
        if head_scale is not None:
            kernel = dequantize(np.asarray(module.head_kernel[...]), np.asarray(head_scale[...]))
            module.head_kernel = type(module.head_kernel)(kernel)
            module.head_scale = None


# The fast tier keeps a dense model; a mixture of experts (routers stay float), a tied head and the
# other architectures are the slow tier's.
_FAST_ARCHS = {"MistralForCausalLM"}
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("arch", [a if a in _FAST_ARCHS else pytest.param(a, marks=_SLOW) for a in ARCHS])
def test_every_architecture_quantizes_every_linear_and_equals_its_dequantized_model(arch, tmp_path):
    path = save_tiny(arch, str(tmp_path / arch))
    config, model = load_model(path, on_host=True)
    count = quantize_int8(model)
    routers = {id(m.router) for _, m in nnx.iter_modules(model) if isinstance(m, SparseMoE)}
    kernels = [m for _, m in nnx.iter_modules(model) if isinstance(m, (Linear, StackedLinear))]
    for module in kernels:
        int8 = module.kernel[...].dtype == np.int8
        assert int8 == (id(module) not in routers), module  # all but the MoE router
        assert (module.kernel_scale is not None) == int8
    assert count == len(kernels) - len(routers) + int(config.tie_word_embeddings)  # + a tied head
    assert model.model.embed_tokens.embedding[...].dtype == np.float32
    assert quantize_int8(model) == 0  # int8 kernels stay as they are
    reference = load_model(path, on_host=True)[1]
    quantize_int8(reference)
    _dequantized_copy(reference)
    put_on_device(model)
    put_on_device(reference)
    (ids,) = prompts([40], seed=3)
    pages = [[1, 2, 3]]
    got, _ = run_step(model, caches(config), [ids], [0], pages)
    expected, _ = run_step(reference, caches(config), [ids], [0], pages)
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)


@functools.cache
def _trained(arch: str, root: str) -> str:
    return save_trained_tiny(arch, f"{root}/{arch}")


# Mixtral's experts are quantized per channel as the dense layers are (its int8 model equals its
# dequantized one in the fast tier, Qwen3-MoE's too): the trained MoE is `make test-full`'s.
@pytest.mark.slow  # trains a tiny model per architecture first
@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", pytest.param("MixtralForCausalLM", marks=pytest.mark.full)]
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_trained_tiny_int8_agrees_with_float_on_the_fixed_text(arch, dtype, tmp_path_factory):
    path = _trained(arch, str(tmp_path_factory.getbasetemp()))
    ids = text_ids(path)
    config, reference = load_model(path, dtype)
    _, model = load_model(path, dtype, on_host=True)
    quantize_int8(model)
    put_on_device(model)
    expected = teacher_forced_logits(reference, config, ids, dtype).argmax(-1)
    got = teacher_forced_logits(model, config, ids, dtype).argmax(-1)
    assert (got == expected).mean() >= 0.97
