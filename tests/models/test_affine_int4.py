# SPDX-License-Identifier: Apache-2.0
"""Affine 4-bit weights (`w = q * s + m`: zero points or group minimums, `models.int4`): the
product of values, scales and offsets equals NumPy's on the dequantized weight; AWQ and
asymmetric GPTQ checkpoints (packed in `awq_checkpoints`, `gptq_checkpoints`, the AWQ packing
checked against vLLM's unpacking order) load as int4 kernels with offsets and compute what the
float model of their dequantized weights does; malformed ones are refused at load by name."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import int4, load_model
from models.awq_checkpoint import unpack_awq
from models.linear import Linear, PackedKernel, is_packed_int4
from pallas_kernels.cpu.dense_int4 import unpack_dense_kernel_int4
from tests.models.awq_checkpoints import quantize_awq, write_awq
from tests.models.fp8_checkpoints import write_float
from tests.models.gptq_checkpoints import quantize_gptq, write_gptq
from tests.models.int4_checkpoints import edit_config
from tests.models.tiny_checkpoints import caches, prompts, run_step, save_tiny


def _affine_linear(rng, inputs: int, outputs: int, groups: int | None) -> tuple[Linear, np.ndarray]:
    q = rng.integers(-8, 8, size=(inputs, outputs)).astype(np.int8)
    shape = (outputs,) if groups is None else (groups, outputs)
    scale = rng.uniform(0.01, 0.1, size=shape).astype(np.float32)
    offset = rng.uniform(-0.5, 0.5, size=shape).astype(np.float32)
    linear = Linear(inputs, outputs, bias=False, dtype=jnp.float32)
    linear.kernel = nnx.Param(q)
    linear.kernel_scale, linear.kernel_offset = nnx.Param(scale), nnx.Param(offset)
    size = inputs if groups is None else inputs // groups
    s, m = (scale[None], offset[None]) if groups is None else (scale, offset)
    w = q.astype(np.float32) * np.repeat(s, size, axis=0) + np.repeat(m, size, axis=0)
    return linear, w


@pytest.mark.parametrize("groups", [4, None])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_affine_product_equals_the_dequantized_weight(groups, dtype):
    rng = np.random.default_rng(0)
    linear, w = _affine_linear(rng, 128, 48, groups)
    np.testing.assert_allclose(
        int4.dequantize_affine(linear.kernel[...], linear.kernel_scale[...], linear.kernel_offset[...]),
        w, rtol=1e-6, atol=1e-6,
    )  # fmt: skip
    x = rng.normal(size=(5, 128)).astype(np.float32)
    got = np.asarray(linear.product(jnp.asarray(x, dtype)), np.float32)
    expected = np.asarray(jnp.asarray(x, dtype), np.float32) @ w
    tolerance = 1e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance * np.abs(expected).max())


def test_fused_affine_projection_keeps_each_parts_offsets():
    rng = np.random.default_rng(1)
    (a, wa), (b, wb) = _affine_linear(rng, 64, 16, 2), _affine_linear(rng, 64, 32, 2)
    fused = Linear.concatenated([a, b], blocks=2)
    x = rng.normal(size=(3, 64)).astype(np.float32)
    expected = np.concatenate([x @ wa[:, :8], x @ wb[:, :16], x @ wa[:, 8:], x @ wb[:, 16:]], axis=1)
    np.testing.assert_allclose(np.asarray(fused.product(jnp.asarray(x))), expected, rtol=1e-4, atol=1e-4)


def test_awq_packing_is_the_order_vllm_unpacks():
    """vLLM's AWQ unpacking (`moe_wna16`'s and the Triton kernel's reverse order): each word's
    fields from the lowest, then columns `[0, 4, 1, 5, 2, 6, 3, 7]` of them."""
    import torch

    w = np.random.default_rng(2).normal(size=(24, 64)).astype(np.float32)  # HF [out, in]
    packed = quantize_awq(w, 16)
    assert packed["qweight"].shape == (64, 3) and packed["qzeros"].shape == (4, 3)

    def vllm_unpack(words: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(words).view(torch.uint8)  # little-endian: 2 fields a byte
        t = (t[:, :, None] >> torch.tensor([0, 4], dtype=torch.uint8)) & 0xF
        return t.reshape(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(words.shape[0], -1).numpy()

    u, z = vllm_unpack(packed["qweight"]), vllm_unpack(packed["qzeros"])
    np.testing.assert_array_equal(unpack_awq(packed["qweight"]), u)
    scale = packed["scales"].astype(np.float32)
    reference = (u.astype(np.float32) - np.repeat(z, 16, axis=0)) * np.repeat(scale, 16, axis=0)
    np.testing.assert_array_equal(reference.T, packed["dequantized"])
    np.testing.assert_allclose(packed["dequantized"], w, atol=np.abs(w).max() / 7)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return save_tiny("MistralForCausalLM", str(tmp_path_factory.mktemp("affine") / "source"))


def _assert_computes_the_dequantized_model(path: str, float_path: str, groups: int | None) -> None:
    config, model = load_model(path)
    _, reference = load_model(float_path)
    down = model.model.layers[1].mlp.down_proj
    values = np.asarray(down.kernel[...]).astype(np.int8)
    assert values.min() >= -8 and values.max() <= 7 and values.min() < -4  # 4-bit values, spread
    assert (
        down.kernel_offset[...].shape == down.kernel_scale[...].shape == ((groups,) if groups else ()) + (64,)
    )
    (ids,) = prompts([40], seed=4)
    got, _ = run_step(model, caches(config), [ids], [0], [[1, 2, 3]])
    expected, _ = run_step(reference, caches(config), [ids], [0], [[1, 2, 3]])
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)


def test_awq_loads_as_affine_int4_and_computes_the_dequantized_model(mistral, tmp_path):
    path, dequantized = write_awq(mistral, str(tmp_path / "awq"), group_size=32)
    float_path = write_float(mistral, str(tmp_path / "float"), dequantized)
    _assert_computes_the_dequantized_model(path, float_path, 128 // 32)


@pytest.mark.slow  # a second load into the affine layout (fast: AWQ's)
@pytest.mark.parametrize("group_size", [32, None])
def test_asymmetric_gptq_loads_as_affine_int4(mistral, group_size, tmp_path):
    w = np.random.default_rng(3).normal(size=(8, 32)).astype(np.float32) + 0.3  # skewed: zeros != 8
    packed = quantize_gptq(w, 16, sym=False)
    assert len(np.unique(packed["qzeros"])) > 1
    np.testing.assert_allclose(packed["dequantized"], w, atol=np.abs(w).max() / 7)
    path, dequantized = write_gptq(mistral, str(tmp_path / "gptq"), group_size=group_size, sym=False)
    float_path = write_float(mistral, str(tmp_path / "float"), dequantized)
    _assert_computes_the_dequantized_model(path, float_path, 128 // group_size if group_size else None)


def _rewrite(path: str, edit) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(f"{path}/model.safetensors")
    edit(tensors)
    save_file(tensors, f"{path}/model.safetensors")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(bits=8), "bits=8"),
        (dict(zero_point=False), "zero_point=false"),
        (dict(version="gemv"), "version 'gemv'"),
        (dict(group_size=0), "group_size 0"),
    ],
)
def test_unsupported_awq_configs_are_refused_by_name(mistral, change, message, tmp_path):
    path, _ = write_awq(mistral, str(tmp_path / "awq"), group_size=32)
    edit_config(path, lambda c: c["quantization_config"].update(change))
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_malformed_affine_checkpoints_are_refused_by_name(mistral, tmp_path):
    path, _ = write_awq(mistral, str(tmp_path / "awq"), group_size=32)
    _rewrite(path, lambda t: t.pop("model.layers.0.self_attn.o_proj.qzeros"))
    with pytest.raises(ValueError, match=r"o_proj\.qzeros"):
        load_model(path)
    path, _ = write_awq(mistral, str(tmp_path / "awq2"), group_size=32)
    name = "model.layers.0.mlp.up_proj.qzeros"
    _rewrite(path, lambda t: t.update({name: t[name][:1].copy()}))
    with pytest.raises(ValueError, match=r"up_proj\.qzeros holds zero points"):
        load_model(path)
    path, _ = write_gptq(mistral, str(tmp_path / "gptq"), group_size=32, sym=False)
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.gate_proj.scales"))
    with pytest.raises(ValueError, match=r"gate_proj\.scales"):
        load_model(path)


@pytest.mark.slow  # a second load; the fast tier loads AWQ's affine layout
def test_a_float_checkpoint_streams_into_the_affine_layout_with_zero_offsets(mistral):
    """A projection the checkpoint holds in float, served in the affine layout (`int4z`), is
    quantized on its way like a symmetric int4 one and gets zero offsets: the same logits as the
    symmetric layout's."""
    import jax

    from tpu_platform.weights.preparation import Preparation
    from tpu_platform.weights.prepared import load_prepared

    on_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    config, affine = load_prepared(mistral, Preparation("float32", quantization="int4z-g32"), on_device)
    _, symmetric = load_prepared(mistral, Preparation("float32", quantization="int4-g32"), on_device)
    layer = affine.model.layers[0]
    for linear in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        assert linear.kernel_offset[...].shape == linear.kernel_scale[...].shape
        assert not np.asarray(linear.kernel_offset[...]).any()
    assert (
        affine.lm_head.kernel_offset is None and symmetric.model.layers[0].mlp.down_proj.kernel_offset is None
    )
    (ids,) = prompts([24], seed=2)
    got, _ = run_step(affine, caches(config), [ids], [0], [[1, 2]])
    expected, _ = run_step(symmetric, caches(config), [ids], [0], [[1, 2]])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the fast tier's int4 model on the native kernel: test_gguf_q4.py
def test_a_float_checkpoint_streams_onto_the_native_int4_kernel(mistral, dense_kernels):
    """Prepared for the native CPU kernels, the float projections are quantized to 4-bit values on
    their way (int4's scales, max|w| / 7.5 per group: int8's range could not pack two a byte) and
    packed for the int4 kernel, which computes what XLA's dots compute from the same values."""
    import jax

    from tpu_platform.weights.preparation import Preparation
    from tpu_platform.weights.prepared import load_prepared

    on_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    native = Preparation("float32", "native+f32", quantization="int4z-g32")
    config, packed = load_prepared(mistral, native, on_device)
    _, floats = load_model(mistral, jnp.float32)
    down = packed.model.layers[0].mlp.down_proj
    assert isinstance(down.kernel, PackedKernel) and is_packed_int4(down.kernel[...])
    _, scale = int4.quantize(np.asarray(floats.model.layers[0].mlp.down_proj.kernel[...]), 32)
    np.testing.assert_allclose(down.kernel_scale[...], scale, rtol=1e-6)
    _, on_xla = load_prepared(mistral, native, on_device)
    for _, module in nnx.iter_modules(on_xla):  # the same values, unpacked onto XLA's int8 dots
        if isinstance(module, Linear) and is_packed_int4(module.kernel[...]):
            module.kernel = nnx.Param(unpack_dense_kernel_int4(module.kernel[...]))
    (ids,) = prompts([24], seed=2)
    got, _ = run_step(packed, caches(config), [ids], [0], [[1, 2]])
    expected, _ = run_step(on_xla, caches(config), [ids], [0], [[1, 2]])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # a load and a step; the int8 head's kernel is in the fast kernel tests
def test_a_tied_head_is_int8_on_the_native_kernels_in_the_4_bit_preparation(tmp_path, dense_kernels):
    """Packed for the native CPU kernels, a 4-bit preparation holds a tied head's copy as int8 in
    the projections' groups (int8's `max|w| / 127` scales, as a GGUF's Q8_0 embedding is), for
    the native int8 kernel; the logits are those of the same weights on XLA's dots, the head's
    int8 copy unpacked there."""
    import jax

    from models import int8
    from models.layers import HeadCopy
    from pallas_kernels.cpu.dense_int8 import unpack_dense_kernel_int8
    from tpu_platform.weights.preparation import Preparation
    from tpu_platform.weights.prepared import load_prepared

    path = save_tiny("Qwen3ForCausalLM", str(tmp_path / "qwen3"))  # tied embeddings
    on_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    native = Preparation("float32", "native+f32", quantization="int4z-g32")
    config, packed = load_prepared(path, native, on_device)
    head = packed.model.embed_tokens
    assert isinstance(head.head_kernel, PackedKernel) and head.head_kernel[...].dtype == np.int8
    embedding = np.asarray(head.embedding[...])
    q, scale = int8.quantize(embedding.T, 32)
    np.testing.assert_array_equal(np.asarray(unpack_dense_kernel_int8(head.head_kernel[...])), q)
    np.testing.assert_allclose(head.head_scale[...], scale, rtol=1e-6)
    _, on_xla = load_prepared(path, native, on_device)
    for _, module in nnx.iter_modules(on_xla):  # the same values on XLA's int8 dots
        if isinstance(module, Linear) and is_packed_int4(module.kernel[...]):
            module.kernel = nnx.Param(unpack_dense_kernel_int4(module.kernel[...]))
    xla_head = on_xla.model.embed_tokens
    xla_head.head_kernel = HeadCopy(unpack_dense_kernel_int8(xla_head.head_kernel[...]))
    (ids,) = prompts([24], seed=2)
    got, _ = run_step(packed, caches(config), [ids], [0], [[1, 2]])
    expected, _ = run_step(on_xla, caches(config), [ids], [0], [[1, 2]])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
