# SPDX-License-Identifier: Apache-2.0
"""4-bit weights: the unpacking against the compressed-tensors package's own packer, compressed-
tensors W4A16 checkpoints (written by the package: `int4_checkpoints`) loading as int4 kernels
with the checkpoint's own values and computing what the float model of the package's own
decompressed weights does, and malformed 4-bit checkpoints refused at load by name."""

import numpy as np
import pytest
from safetensors import safe_open

from models import int4, load_model
from tests.models.fp8_checkpoints import write_float
from tests.models.int4_checkpoints import (
    edit_config,
    write_compressed_w4a16,
    write_decompressed,
    write_packed_w4a16,
)
from tests.models.tiny_checkpoints import caches, prompts, run_step, save_tiny


@pytest.mark.parametrize("packed_dim", [1, 0])
def test_unpacking_inverts_the_package_s_packing(packed_dim):
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = np.random.default_rng(0).integers(-8, 8, (12, 21)).astype(np.int8)  # 21, 12: padded words
    packed = pack_to_int32(torch.from_numpy(q), 4, packed_dim=packed_dim).numpy()
    length = q.shape[packed_dim]
    values = int4.unpack_int32(packed, axis=packed_dim, length=length)
    assert values.dtype == int4.INT4_DTYPE
    np.testing.assert_array_equal(values.astype(np.int8), q)


def test_quantize_grouped_is_the_symmetric_4_bit_range():
    w = np.random.default_rng(1).normal(size=(64, 6)).astype(np.float32)
    w[:, 2] = 0
    q, scale = int4.quantize_grouped(w, 32)
    assert q.dtype == int4.INT4_DTYPE and scale.shape == (2, 6)
    amax = np.abs(w.reshape(2, 32, 6)).max(axis=1)
    np.testing.assert_allclose(scale, np.where(amax > 0, amax / 7.5, 1), rtol=1e-7)
    values = q.astype(np.int8).reshape(2, 32, 6)
    assert values.min() >= -8 and values.max() <= 7
    np.testing.assert_array_equal(values, np.clip(np.round(w.reshape(2, 32, 6) / scale[:, None]), -8, 7))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return save_tiny("MistralForCausalLM", str(tmp_path_factory.mktemp("int4") / "source"))


@pytest.mark.parametrize("group_size", [32, None])  # a scale per 32 inputs a row; per channel
def test_compressed_w4a16_loads_as_it_is(mistral, group_size, tmp_path):
    out = write_compressed_w4a16(mistral, str(tmp_path / "w4a16"), group_size=group_size)
    config, model = load_model(out)
    _, reference = load_model(write_decompressed(out, str(tmp_path / "float")))
    layer = model.model.layers[0]
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
    # int4 values, held as int8 on CPU (`int4.held_dtype`)
    assert qkv.kernel[...].dtype == down.kernel[...].dtype == int4.held_dtype() == np.int8
    # The checkpoint's own 4-bit values, unchanged (the fused kernel's q columns come first).
    with safe_open(f"{out}/model.safetensors", framework="numpy") as f:
        packed = f.get_tensor("model.layers.0.self_attn.q_proj.weight_packed")
    q = int4.unpack_int32(packed)
    np.testing.assert_array_equal(np.asarray(qkv.kernel[...])[:, : q.shape[0]], q.T.astype(np.int8))
    scales = (qkv.in_features // group_size,) if group_size else ()
    assert qkv.kernel_scale[...].shape == (*scales, qkv.out_features)
    assert model.lm_head.kernel[...].dtype == np.float32  # ignored by the checkpoint: as it was
    (ids,) = prompts([40], seed=4)
    got, _ = run_step(model, caches(config), [ids], [0], [[1, 2, 3]])
    expected, _ = run_step(reference, caches(config), [ids], [0], [[1, 2, 3]])
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("group_size", [32, None])
def test_compressed_w4a16_with_zero_points_computes_the_decompressed_model(mistral, group_size, tmp_path):
    """`symmetric: false`, written by the package: its zero points packed eight rows a word
    (`weight_zero_point [out / 8, in / G]`) load as offsets `-zp * s` beside the unchanged int4
    values; the logits are the float model's of the package's own decompression."""
    out = write_compressed_w4a16(mistral, str(tmp_path / "w4a16"), group_size=group_size, symmetric=False)
    with safe_open(f"{out}/model.safetensors", framework="numpy") as f:
        zeros = f.get_tensor("model.layers.0.mlp.down_proj.weight_zero_point")
        packed = f.get_tensor("model.layers.0.mlp.down_proj.weight_packed")
    assert zeros.dtype == np.int32 and zeros.shape == (64 // 8, 128 // group_size if group_size else 1)
    unsigned = int4.unpack_unsigned(zeros, axis=0)
    assert len(np.unique(unsigned)) > 3  # zero points, not all 8 (symmetric)
    config, model = load_model(out)
    _, reference = load_model(write_decompressed(out, str(tmp_path / "float")))
    down = model.model.layers[0].mlp.down_proj
    np.testing.assert_array_equal(np.asarray(down.kernel[...]), int4.unpack_int32(packed).T.astype(np.int8))
    assert down.kernel_offset[...].shape == down.kernel_scale[...].shape
    (ids,) = prompts([40], seed=4)
    got, _ = run_step(model, caches(config), [ids], [0], [[1, 2, 3]])
    expected, _ = run_step(reference, caches(config), [ids], [0], [[1, 2, 3]])
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)


def test_compressed_zero_points_of_the_wrong_shape_are_refused_by_name(mistral, tmp_path):
    from safetensors.numpy import load_file, save_file

    out = write_compressed_w4a16(mistral, str(tmp_path / "w4a16"), group_size=32, symmetric=False)
    tensors = load_file(f"{out}/model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight_zero_point"
    tensors[name] = tensors[name][:, :1]
    save_file(tensors, f"{out}/model.safetensors")
    with pytest.raises(ValueError, match=r"up_proj\.weight_zero_point holds zero points"):
        load_model(out)


def _weights(config: dict) -> dict:
    return config["quantization_config"]["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: _weights(c).update(num_bits=2), "8-bit symmetric or 4-bit int weights"),
        (lambda c: _weights(c).update(symmetric=False), r"\(symmetric false\) lacks .*\.weight_zero_point"),
        (lambda c: c["quantization_config"].update(format="int-quantized"), "come 'pack-quantized'"),
        (lambda c: _weights(c).update(actorder="group"), "reorders its inputs"),
    ],
)
def test_malformed_4_bit_checkpoints_are_refused_by_name(mistral, change, message, tmp_path):
    out = write_compressed_w4a16(mistral, str(tmp_path / "w4a16"), group_size=32)
    edit_config(out, change)
    with pytest.raises(ValueError, match=message):
        load_model(out)


def test_a_4_bit_weight_of_the_wrong_shape_is_refused_by_name(mistral, tmp_path):
    from safetensors.numpy import load_file, save_file

    out = write_compressed_w4a16(mistral, str(tmp_path / "w4a16"), group_size=32)
    tensors = load_file(f"{out}/model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight_scale"
    tensors[name] = tensors[name][:, :1]  # one group of the two
    save_file(tensors, f"{out}/model.safetensors")
    with pytest.raises(ValueError, match="up_proj"):
        load_model(out)


@pytest.mark.slow  # routed int4 experts load in test_int4_moe.py's fast tests
def test_moe_experts_load_as_int4_with_group_scales(tmp_path):
    """Qwen3-MoE W4A16: each expert's 4-bit values and group scales stacked `[E, in / G, out]`,
    the routed experts computing what the float model of the dequantized weights does."""
    source = save_tiny("Qwen3MoeForCausalLM", str(tmp_path / "source"))
    path, dequantized = write_packed_w4a16(source, str(tmp_path / "w4a16"), group_size=16)
    write_float(source, str(tmp_path / "float"), dequantized)
    config, model = load_model(path)
    _, reference = load_model(str(tmp_path / "float"))
    experts = model.model.layers[0].mlp.experts
    assert experts.down_proj.kernel[...].dtype == int4.held_dtype()
    assert experts.down_proj.kernel_scale[...].shape == (8, 32 // 16, 64)
    assert model.model.layers[0].mlp.router.kernel_scale is None
    (ids,) = prompts([40], seed=4)
    got, _ = run_step(model, caches(config), [ids], [0], [[1, 2, 3]])
    expected, _ = run_step(reference, caches(config), [ids], [0], [[1, 2, 3]])
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)


def test_a_tensor_parallel_size_cutting_4_bit_groups_is_refused_by_name(mistral, tmp_path):
    """down_proj's 128 inputs in 4 groups of 32: 2 or 4 devices hold whole groups, 8 would cut
    them (refused, naming the parameter and the sizes that work); scales per channel never cut."""
    from jax.sharding import PartitionSpec

    from models.sharding import MODEL_AXIS, parameter_spec

    _, model = load_model(write_compressed_w4a16(mistral, str(tmp_path / "w4a16"), group_size=32))
    name = "model.layers.0.mlp.down_proj.kernel_scale"
    shape = model.model.layers[0].mlp.down_proj.kernel_scale[...].shape
    assert shape == (4, 64) and parameter_spec(name, shape, 4) == PartitionSpec(MODEL_AXIS, None)
    with pytest.raises(
        ValueError, match=r"cannot split model\.layers\.0\.mlp\.down_proj\.kernel_scale.*dividing 4"
    ):
        parameter_spec(name, shape, 8)
    assert parameter_spec(name, (64,), 8) == PartitionSpec()  # per channel: replicated rows' scales
