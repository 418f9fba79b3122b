# SPDX-License-Identifier: Apache-2.0
"""compressed-tensors int8 checkpoints, written here by hand (NumPy + safetensors: the format's
tensors and config), load as they are and match the float model of their dequantized weights."""

import json
import os
import re
import shutil

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from models import load_model
from models.compressed_tensors import unpack_int32
from tests.models.tiny_checkpoints import caches, prompts, run_step, save_tiny

# The projections a compressed-tensors recipe quantizes ("Linear" targets; lm_head and the MoE
# router `mlp.gate` ignored, as llm-compressor's recipes do).
_QUANTIZED = re.compile(r"_proj\.weight$")


GROUP_SIZE = 16  # the `group` strategy's inputs per scale here


def _group(strategy: str, activations: bool) -> dict:
    size = GROUP_SIZE if strategy == "group" else None
    weights = dict(num_bits=8, type="int", symmetric=True, strategy=strategy, dynamic=False, group_size=size)
    dynamic = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    return {"targets": ["Linear"], "weights": weights, "input_activations": dynamic if activations else None}


def pack_int8(q: np.ndarray) -> np.ndarray:
    """compressed-tensors' 8-bit packing, by hand: values + 128 as bytes, four to an int32 word,
    the first in the lowest byte; a row's last word padded with zero bytes."""
    rows, cols = q.shape
    padded = np.zeros((rows, -(-cols // 4) * 4), np.uint32)
    padded[:, :cols] = (q.astype(np.int16) + 128).astype(np.uint32)
    words = padded.reshape(rows, -1, 4)
    return (words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24).view(np.int32)


def write_compressed(source: str, out: str, *, fmt: str, strategy: str) -> dict[str, np.ndarray]:
    """`source`'s checkpoint with its projections quantized (`fmt`, `strategy`), at `out`; returns
    the dequantized float weights (the reference) by name."""
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors, dequantized = {}, {}
    with safe_open(os.path.join(source, "model.safetensors"), framework="numpy") as f:
        for name in f.keys():
            w = f.get_tensor(name)
            if not _QUANTIZED.search(name):
                tensors[name] = dequantized[name] = w
                continue
            if strategy == "group":  # HF [out, in]: a scale per row and run of GROUP_SIZE inputs
                blocks = w.reshape(w.shape[0], -1, GROUP_SIZE)
                scale = (np.abs(blocks).max(axis=2, keepdims=True) / 127).astype(np.float32)
                q = np.clip(np.rint(blocks / scale), -127, 127).astype(np.int8)
                dequantized[name] = (q.astype(np.float32) * scale).reshape(w.shape)
                q, scale = q.reshape(w.shape), scale[..., 0]  # scale [out, in / G]
            else:
                axis = 1 if strategy == "channel" else None  # HF [out, in]: a row per output channel
                scale = (np.abs(w).max(axis=axis, keepdims=True) / 127).astype(np.float32)
                q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
                dequantized[name] = (q.astype(np.float32) * scale).astype(np.float32)
            base = name.removesuffix("weight")
            if strategy != "group":  # `[out, 1]` a row, or `[1]`
                scale = scale.reshape(-1, 1) if strategy == "channel" else scale.reshape(1)
            tensors[f"{base}weight_scale"] = scale
            if fmt == "pack-quantized":
                tensors[f"{base}weight_packed"] = pack_int8(q)
                tensors[f"{base}weight_shape"] = np.asarray(q.shape, np.int64)
            else:
                tensors[f"{base}weight"] = q
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": _group(strategy, activations=fmt != "pack-quantized")},
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return dequantized


def write_float(source: str, out: str, weights: dict[str, np.ndarray]) -> None:
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(weights, os.path.join(out, "model.safetensors"))


def test_hand_packing_is_the_format_s_own():
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = np.random.default_rng(0).integers(-127, 128, (5, 10)).astype(np.int8)  # 10: a padded word
    np.testing.assert_array_equal(pack_int8(q), pack_to_int32(torch.from_numpy(q), 8).numpy())
    np.testing.assert_array_equal(unpack_int32(pack_int8(q))[:, :10], q)


@pytest.mark.parametrize(
    ("arch", "fmt", "strategy"),
    [
        ("MistralForCausalLM", "pack-quantized", "channel"),  # W8A16
        ("MistralForCausalLM", "int-quantized", "tensor"),  # W8A8 weights, one scale a tensor
        # experts stacked from int8 tensors; a grouped scale: programs of their own, the slow tier's
        pytest.param("Qwen3MoeForCausalLM", "pack-quantized", "channel", marks=pytest.mark.slow),
        pytest.param(
            "MistralForCausalLM", "pack-quantized", "group", marks=pytest.mark.slow
        ),  # W8A16, a scale per 16 inputs a row
    ],
)
def test_compressed_checkpoint_loads_as_it_is(arch, fmt, strategy, tmp_path):
    source = save_tiny(arch, str(tmp_path / "source"))
    dequantized = write_compressed(source, str(tmp_path / "int8"), fmt=fmt, strategy=strategy)
    write_float(source, str(tmp_path / "float"), dequantized)
    config, model = load_model(str(tmp_path / "int8"))
    _, reference = load_model(str(tmp_path / "float"))
    layer = model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert qkv.kernel[...].dtype == np.int8 and qkv.kernel_scale[...].dtype == np.float32
    # The checkpoint's own int8 values, unchanged (the fused kernel's q columns come first).
    with safe_open(str(tmp_path / "int8" / "model.safetensors"), framework="numpy") as f:
        name = "model.layers.0.self_attn.q_proj.weight"
        stored = f.get_tensor(f"{name}_packed") if fmt == "pack-quantized" else f.get_tensor(name)
    q = unpack_int32(stored) if fmt == "pack-quantized" else stored
    np.testing.assert_array_equal(np.asarray(qkv.kernel[...])[:, : q.shape[0]], q.T)
    assert model.lm_head.kernel[...].dtype == np.float32  # ignored by the checkpoint: as it was
    if strategy == "group":  # the checkpoint's block scales, `[in / G, out]`
        assert qkv.kernel_scale[...].shape == (qkv.in_features // GROUP_SIZE, qkv.out_features)
        assert layer.mlp.down_proj.kernel_scale[...].shape[0] == layer.mlp.down_proj.in_features // GROUP_SIZE
    if arch == "Qwen3MoeForCausalLM":
        experts = layer.mlp.experts
        assert experts.gate_proj.kernel[...].dtype == np.int8
        assert experts.down_proj.kernel_scale[...].shape == (8, 64)
        assert layer.mlp.router.kernel_scale is None
    (ids,) = prompts([40], seed=4)
    got, _ = run_step(model, caches(config), [ids], [0], [[1, 2, 3]])
    expected, _ = run_step(reference, caches(config), [ids], [0], [[1, 2, 3]])
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)


def test_grouped_expert_scales_are_refused_by_name(tmp_path):
    source = save_tiny("Qwen3MoeForCausalLM", str(tmp_path / "source"))
    write_compressed(source, str(tmp_path / "int8"), fmt="pack-quantized", strategy="group")
    with pytest.raises(ValueError, match="one int8 scale per channel for MoE experts"):
        load_model(str(tmp_path / "int8"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(num_bits=2), "group 'group_0' has weights"),  # 8 and 4 bits are served
        (dict(symmetric=False), "group 'group_0' has weights"),
        (dict(strategy="block"), "group 'group_0' has weights"),
        (dict(strategy="group"), "'group' without a group_size"),
        (dict(strategy="group", group_size=16, actorder="group"), "reorders its inputs"),
    ],
)
def test_other_compressed_schemes_are_refused_by_name(tmp_path, change, message):
    source = save_tiny("MistralForCausalLM", str(tmp_path / "source"))
    write_compressed(source, str(tmp_path / "int8"), fmt="pack-quantized", strategy="channel")
    path = tmp_path / "int8" / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path / "int8"))
