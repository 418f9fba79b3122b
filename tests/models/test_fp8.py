# SPDX-License-Identifier: Apache-2.0
"""fp8 weights: the quantizer against NumPy's own arithmetic, fp8 checkpoints (compressed-tensors
FP8 written by the compressed-tensors package, `quant_method: fp8` 128x128 block checkpoints
packed in `fp8_checkpoints`) loading as they are and computing what the float model of their
dequantized weights does, fp8 at load from a float checkpoint, and malformed checkpoints refused
at load by name."""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from models import fp8, load_model
from models.quantization import quantize_fp8
from models.weight_stream import stream_model
from tests.models.fp8_checkpoints import (
    dequantized_weights,
    write_block_fp8,
    write_compressed_fp8,
    write_float,
)
from tests.models.tiny_checkpoints import caches, prompts, run_step, save_tiny
from tests.models.tiny_deepseek import save_tiny_deepseek
from tests.tiny_models import save_tiny_llama

# 128 inputs (hidden) and 256 (intermediate): whole 128-input blocks, two of them on down_proj
_WIDTHS = dict(hidden_size=128, intermediate_size=256)


def test_quantize_per_channel_is_e4m3_of_w_over_its_column_scale():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(24, 5)).astype(np.float32) * np.array([1e-3, 1.0, 30.0, 0.0, 500.0], np.float32)
    q, scale = fp8.quantize_per_channel(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale.dtype == np.float32 and scale.shape == (5,)
    amax = np.abs(w).max(axis=0)
    np.testing.assert_allclose(scale, np.where(amax > 0, amax / 448, 1), rtol=1e-7)
    # each value is w / s rounded to the nearest e4m3 (3 significant bits: within 2^-4 relative)
    ratio = w / scale
    np.testing.assert_array_equal(
        q.astype(np.float32), ratio.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    )
    assert np.abs(q.astype(np.float32)).max() == 448  # each column's largest maps to the top value
    err = np.abs(q.astype(np.float32) * scale - w)
    assert np.all(err <= np.maximum(np.abs(w) / 16, scale * 2.0**-9) + 1e-12)


def test_grouped_scales_are_one_per_run_of_inputs_of_each_column():
    w = np.random.default_rng(1).normal(size=(2, 256, 3)).astype(np.float32)  # an expert stack
    q, scale = fp8.quantize_grouped(w, 128)
    assert scale.shape == (2, 2, 3)
    np.testing.assert_allclose(scale[1, 1], np.abs(w[1, 128:]).max(axis=0) / 448, rtol=1e-7)
    dequantized = fp8.dequantize(q, scale)
    np.testing.assert_allclose(dequantized, w, atol=np.abs(w).max() / 16)


def test_block_scales_repeat_each_block_over_its_rows_and_trim_the_last():
    scale_inv = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)  # weight [200, 256] in 128x128 blocks
    held = fp8.block_scales(scale_inv, (200, 256), (128, 128), "w")
    assert held.shape == (200, 2)  # HF orientation [out, in / 128]
    np.testing.assert_array_equal(held[127], [1.0, 2.0])
    np.testing.assert_array_equal(held[128], [3.0, 4.0])
    np.testing.assert_array_equal(held[199], [3.0, 4.0])
    with pytest.raises(ValueError, match="end inside a 128-input block"):
        fp8.block_scales(scale_inv, (200, 200), (128, 128), "w")
    with pytest.raises(ValueError, match=r"has shape \(2, 2\); a weight \(300, 256\)"):
        fp8.block_scales(scale_inv, (300, 256), (128, 128), "w")


def _writer(kind: str):
    if kind == "block":
        return write_block_fp8
    if kind == "block_static":
        return lambda source, out: write_block_fp8(source, out, activation_scheme="static")
    return lambda source, out: write_compressed_fp8(source, out, kind)


@pytest.mark.parametrize(
    ("arch", "kind"),
    [
        ("LlamaForCausalLM", "FP8_DYNAMIC"),  # compressed-tensors: a scale per channel
        ("LlamaForCausalLM", "FP8"),  # per tensor, static activation scales (dropped)
        # compressed-tensors' 128x128 blocks: programs of their own; the fast tier's blocks are below
        pytest.param("LlamaForCausalLM", "FP8_BLOCK", marks=pytest.mark.slow),
        ("LlamaForCausalLM", "block"),  # quant_method fp8, weight_block_size [128, 128]
        # each compiles programs of its own: the slow tier
        pytest.param("Qwen3ForCausalLM", "block_static", marks=pytest.mark.slow),  # a tied head, q/k norms
        # expert stacks with block scales `[E, in / 128, out]`
        pytest.param("Qwen3MoeForCausalLM", "block", marks=pytest.mark.slow),
    ],
)
def test_fp8_checkpoint_loads_as_it_is(arch, kind, tmp_path):
    if arch == "LlamaForCausalLM":
        source = save_tiny_llama(str(tmp_path / "source"), **_WIDTHS)
    else:  # o_proj: 128 inputs; experts 128 wide
        source = save_tiny(arch, str(tmp_path / "source"), head_dim=32, moe_intermediate_size=128, **_WIDTHS)
    out = _writer(kind)(source, str(tmp_path / "fp8"))
    reference_dir = write_float(source, str(tmp_path / "float"), dequantized_weights(out))
    config, model = load_model(out)
    _, reference = load_model(reference_dir)
    layer = model.model.layers[0]
    qkv, down = layer.self_attn.qkv_proj, getattr(layer.mlp, "down_proj", None)
    assert qkv.kernel[...].dtype == fp8.FP8_DTYPE and qkv.kernel_scale[...].dtype == np.float32
    blocks = kind.lower().startswith(("block", "fp8_block"))
    if arch != "Qwen3MoeForCausalLM":  # its layer 0 is MoE
        assert down.kernel_scale[...].shape == ((2, 128) if blocks else (128,))
    with safe_open(f"{out}/model.safetensors", framework="pt") as f:  # its own values, unchanged
        stored = f.get_tensor("model.layers.0.self_attn.q_proj.weight").view(dtype=__import__("torch").uint8)
    q_columns = np.asarray(qkv.kernel[...])[:, : stored.shape[0]].view(np.uint8)
    np.testing.assert_array_equal(q_columns, stored.numpy().T)
    if arch == "Qwen3MoeForCausalLM":
        experts = layer.mlp.experts
        assert experts.gate_proj.kernel[...].dtype == fp8.FP8_DTYPE
        assert experts.down_proj.kernel_scale[...].shape == (8, 1, 128)  # [E, in / 128, out]
        assert layer.mlp.router.kernel_scale is None
    head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
    assert getattr(head, "kernel_scale", None) is None and getattr(head, "head_scale", None) is None
    (ids,) = prompts([40], seed=4)
    got, _ = run_step(model, caches(config), [ids], [0], [[1, 2, 3]])
    expected, _ = run_step(reference, caches(config), [ids], [0], [[1, 2, 3]])
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)


def test_fp8_at_load_quantizes_each_projection_per_channel_and_keeps_the_head(tmp_path):
    source = save_tiny_llama(str(tmp_path / "source"), **_WIDTHS)
    _, model = load_model(source, on_host=True)  # quantized in NumPy, as at load
    _, reference = load_model(source, on_host=True)
    assert quantize_fp8(model) == 2 * 4  # qkv, o, gate_up, down of each of 2 layers
    assert model.lm_head.kernel_scale is None
    down = model.model.layers[1].mlp.down_proj
    q, scale = fp8.quantize_per_channel(np.asarray(reference.model.layers[1].mlp.down_proj.kernel[...]))
    np.testing.assert_array_equal(np.asarray(down.kernel[...]).view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(down.kernel_scale[...]), scale)


def _edit_config(path, edit) -> None:
    file = path / "config.json"
    config = json.loads(file.read_text())
    edit(config["quantization_config"])
    file.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def block_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_block")
    source = save_tiny_llama(str(root / "source"), **_WIDTHS)
    return write_block_fp8(source, str(root / "fp8"))


def _broken(block_checkpoint, tmp_path, drop: str | None = None, replace: dict | None = None) -> str:
    """The block checkpoint with tensor `drop` left out and `replace`'s tensors swapped in."""
    import shutil

    import torch
    from safetensors.torch import save_file

    out = tmp_path / "broken"
    shutil.copytree(block_checkpoint, out)
    with safe_open(f"{block_checkpoint}/model.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys() if name != drop}
    tensors.update({k: torch.from_numpy(v) for k, v in (replace or {}).items()})
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_a_weight_without_its_scale_is_refused_by_name(block_checkpoint, tmp_path):
    out = _broken(block_checkpoint, tmp_path, drop="model.layers.1.mlp.up_proj.weight_scale_inv")
    with pytest.raises(
        ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' .* holds fp8 values without"
    ):
        load_model(str(out))


def test_a_block_scale_of_the_wrong_shape_is_refused_by_name(block_checkpoint, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    out = _broken(block_checkpoint, tmp_path, replace={name: np.ones((1, 1), np.float32)})
    with pytest.raises(ValueError, match=r"down_proj\.weight'_scale_inv has shape \(1, 1\)"):
        load_model(str(out))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(fmt="e5m2"), "fmt 'e5m2' are not supported"),
        (dict(weight_block_size=[128]), r"weight_block_size \[128\] is not \[outputs, inputs\]"),
        (dict(activation_scheme="per_token"), "activation_scheme 'per_token'"),
    ],
)
def test_other_fp8_configs_are_refused_by_name(block_checkpoint, tmp_path, change, message):
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(block_checkpoint, out)
    _edit_config(out, lambda q: q.update(change))
    with pytest.raises(ValueError, match=message):
        load_model(str(out))


def test_inputs_ending_inside_a_block_are_refused_by_name(tmp_path):
    source = save_tiny_llama(str(tmp_path / "source"), hidden_size=64, intermediate_size=128)
    out = write_block_fp8(source, str(tmp_path / "fp8"))
    with pytest.raises(ValueError, match=r"_proj\.weight' .* has 64 inputs, not groups of 128"):
        load_model(out)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(strategy="group", group_size=16), "strategy channel or tensor or block only"),
        (dict(num_bits=4), "8-bit symmetric float"),
        (dict(type="int"), "'float-quantized' holds float"),
    ],
)
def test_other_compressed_float_schemes_are_refused_by_name(tmp_path, change, message):
    source = save_tiny_llama(str(tmp_path / "source"), **_WIDTHS)
    out = tmp_path / "fp8"
    write_compressed_fp8(source, str(out), "FP8_DYNAMIC")
    _edit_config(out, lambda q: q["config_groups"]["group_0"]["weights"].update(change))
    with pytest.raises(ValueError, match=message):
        load_model(str(out))


def test_routed_experts_with_block_scales_compute_the_dequantized_experts():
    """The routed grouped matmul on fp8 expert stacks with a scale per 128 inputs of each column
    equals the dense reference on the dequantized stacks."""
    import jax.numpy as jnp

    from models.moe import experts_dense_reference, experts_routed

    rng = np.random.default_rng(2)
    e, d, f, t, k = 4, 256, 128, 5, 2
    stacks = [rng.normal(size=shape).astype(np.float32) for shape in ((e, d, f), (e, d, f), (e, f, d))]
    quantized = [fp8.quantize_grouped(w, 128) for w in stacks]
    assert [s.shape for _, s in quantized] == [(e, 2, f), (e, 2, f), (e, 1, d)]
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    weights = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
    experts = jnp.asarray([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]], jnp.int32)
    got = experts_routed(
        x, *(jnp.asarray(q) for q, _ in quantized), weights, experts, jax_silu,
        scales=tuple(jnp.asarray(s) for _, s in quantized),
    )  # fmt: skip
    dequantized = [jnp.asarray(fp8.dequantize(q, s)) for q, s in quantized]
    expected = experts_dense_reference(x, *dequantized, weights, experts, jax_silu)
    scale = np.abs(np.asarray(expected)).max()  # float32 sums of other orders: relative to it
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=0, atol=1e-6 * scale)


def jax_silu(v):
    import jax

    return jax.nn.silu(v)


def test_block_expert_scales_split_like_their_kernels_and_a_cut_block_is_refused():
    from jax.sharding import PartitionSpec

    from models.sharding import MODEL_AXIS, parameter_spec

    experts = "model.layers.0.mlp.experts"
    assert parameter_spec(f"{experts}.gate_proj.kernel_scale", (8, 1, 256), 2) == PartitionSpec(
        None, None, MODEL_AXIS
    )
    assert parameter_spec(f"{experts}.down_proj.kernel_scale", (8, 2, 128), 2) == PartitionSpec(
        None, MODEL_AXIS, None
    )
    assert parameter_spec(f"{experts}.down_proj.kernel_scale", (8, 128), 2) == PartitionSpec()  # per channel
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 cannot split .*down_proj\.kernel_scale: .* 1 groups"
    ):
        parameter_spec(f"{experts}.down_proj.kernel_scale", (8, 1, 128), 2)
    with pytest.raises(ValueError, match=r"cannot split model\.layers\.0\.self_attn\.o_proj\.kernel_scale"):
        parameter_spec("model.layers.0.self_attn.o_proj.kernel_scale", (1, 128), 2)


@pytest.mark.slow  # programs of fp8 kernels of their own
def test_deepseek_v3_as_released_keeps_its_latent_up_projection_fp8(tmp_path):
    """DeepSeek-V3/R1's checkpoints quantize `kv_b_proj` in 128x128 blocks like every projection:
    it stays fp8 with its scales on the device, and the model computes what the dequantized
    checkpoint does."""
    # Every quantized projection's inputs in whole 128-wide blocks.
    widths = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, q_lora_rank=128,
                  kv_lora_rank=128, v_head_dim=32)  # fmt: skip
    source = save_tiny_deepseek("v3_noaux_yarn", str(tmp_path / "source"), seed=2, **widths)
    out = write_block_fp8(source, str(tmp_path / "fp8"))
    with safe_open(f"{out}/model.safetensors", framework="pt") as f:
        assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv" in f.keys()
    reference_dir = write_float(source, str(tmp_path / "float"), dequantized_weights(out))
    config, model = load_model(out)
    _, reference = load_model(reference_dir)
    up = model.model.layers[0].self_attn.kv_b_proj
    assert up.kernel[...].dtype == fp8.FP8_DTYPE
    assert up.kernel_scale[...].shape == (1, up.kernel[...].shape[1])  # [L / 128, N * (Dn + Dv)]
    # Streamed tensor by tensor onto the served structure, as the runner loads: the same.
    _, streamed = stream_model(out, prepare=lambda m: quantize_fp8(m, 128))
    assert streamed.model.layers[0].self_attn.kv_b_proj.kernel[...].dtype == fp8.FP8_DTYPE
    (ids,) = prompts([40], seed=4)
    expected, _ = run_step(reference, caches(config), [ids], [0], [[1, 2, 3]])
    for served in (model, streamed):
        got, _ = run_step(served, caches(config), [ids], [0], [[1, 2, 3]])
        np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.slow  # a streamed load; the fast tier loads fp8 checkpoints whole
def test_layers_the_checkpoint_keeps_float_stay_float_when_streamed(tmp_path):
    """A block-fp8 checkpoint's `ignored_layers` hold float weights. Streamed tensor by tensor onto
    the served structure (the runner's load, its preparation quantizing to fp8) they stay float,
    as the whole-model loader keeps them, and the model computes the checkpoint's own weights."""
    source = save_tiny_llama(str(tmp_path / "source"), **_WIDTHS)
    ignored = tuple(f"model.layers.{i}.{m}" for i, m in ((0, "self_attn.o_proj"), (1, "mlp.down_proj"),
                    (1, "mlp.gate_proj"), (1, "mlp.up_proj")))  # fmt: skip
    out = write_block_fp8(source, str(tmp_path / "fp8"), ignored=ignored)
    config, reference = load_model(write_float(source, str(tmp_path / "float"), dequantized_weights(out)))
    _, streamed = stream_model(out, prepare=lambda m: quantize_fp8(m, 128))
    _, whole = load_model(out)
    for served in (streamed, whole):
        layers = served.model.layers
        for kept in (layers[0].self_attn.o_proj, layers[1].mlp.down_proj, layers[1].mlp.gate_up_proj):
            assert kept.kernel[...].dtype == np.float32 and kept.kernel_scale is None
        assert layers[1].self_attn.o_proj.kernel[...].dtype == fp8.FP8_DTYPE  # the others as shipped
    (ids,) = prompts([40], seed=4)
    expected, _ = run_step(reference, caches(config), [ids], [0], [[1, 2, 3]])
    got, _ = run_step(streamed, caches(config), [ids], [0], [[1, 2, 3]])
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)
