# SPDX-License-Identifier: Apache-2.0
"""4-bit checkpoints of tiny float ones, for the tests: compressed-tensors W4A16 written by the
compressed-tensors package itself (its scheme applied to the transformers model, the scales a
min-max observer would find, its `ModelCompressor` packing and saving: no calibration data), and
read back by the package's own decompressor as float32 weights by HF name (the reference that
transformers then runs)."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np

# The projections a recipe quantizes (Qwen3.5's in_proj_qkv / _z / _b / _a too).
PROJECTIONS = re.compile(r"_proj(_qkvz?|_ba|_[zba])?\.weight$")

# What recipes quantize: the projections (experts' too); not lm_head, not a MoE router.
IGNORED = ["lm_head", "re:.*mlp.gate$"]


def write_compressed_w4a16(
    source: str,
    out: str,
    *,
    group_size: int | None,
    symmetric: bool = True,
    model_class: str = "AutoModelForCausalLM",
    ignore: list[str] = IGNORED,
) -> str:
    """`source` (a float transformers checkpoint) as a compressed-tensors `pack-quantized` 4-bit
    checkpoint at `out`: one scale per `group_size` inputs of each output channel (None: per
    channel), symmetric (or with zero points). `model_class`: the transformers class that loads
    `source` (a multimodal checkpoint's own); `ignore`: the recipe's modules left in float."""
    import torch
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = getattr(transformers, model_class).from_pretrained(source, dtype=torch.float32)
    strategy = "channel" if group_size is None else "group"
    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for _, module in model.named_modules():
            if hasattr(module, "weight_scale"):
                w = module.weight
                blocks = w.reshape(w.shape[0], -1, group_size or w.shape[1])
                scale, zero = calculate_qparams(blocks.amin(dim=-1), blocks.amax(dim=-1), weights)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    copy_tokenizer(source, out)
    return out


def copy_tokenizer(source: str, out: str) -> None:
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens")) and not os.path.exists(os.path.join(out, name)):
            shutil.copy(os.path.join(source, name), out)


def write_decompressed(path: str, out: str) -> str:
    """The compressed-tensors checkpoint at `path` as the package itself decompresses it
    (transformers loading it dequantized), saved at `out` as a float32 checkpoint: the reference."""
    import torch
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    model.save_pretrained(out)
    tensors = _read(out)
    weights = {n: t for n, t in tensors.items() if not n.endswith(_QUANTIZATION_PARAMS)}
    save_file(weights, f"{out}/model.safetensors")
    edit_config(out, lambda c: c.pop("quantization_config", None))
    copy_tokenizer(path, out)
    return out


def _read(path: str) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="numpy") as f:
                tensors |= {k: f.get_tensor(k) for k in f.keys()}
            os.remove(os.path.join(path, name))
    return tensors


_QUANTIZATION_PARAMS = ("_scale", "_shape", "_zero_point", "_packed", "_g_idx")


def edit_config(path: str, edit) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    edit(config)
    with open(file, "w") as f:
        json.dump(config, f)


def write_packed_w4a16(
    source: str, out: str, *, group_size: int, symmetric: bool = True
) -> tuple[str, dict[str, np.ndarray]]:
    """`source` as a compressed-tensors W4A16 checkpoint whose every projection (a MoE model's
    experts, one tensor each, too) is quantized here (symmetric, `max|w| / 7.5` a group) and
    packed by the package's own `pack_to_int32`: the package's compressor quantizes Linear
    modules only, and transformers holds a MoE model's experts fused. `symmetric` false: the
    package's own min-max qparams (`calculate_qparams`), `quantize` and zero points packed eight
    rows a word (`packed_dim=0`), the reference its own `dequantize`. Returns the path and the
    dequantized weights by HF name."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.numpy import load_file, save_file

    tensors, dequantized = {}, {}
    for name, w in load_file(os.path.join(source, "model.safetensors")).items():
        if not PROJECTIONS.search(name):
            tensors[name] = dequantized[name] = w
            continue
        base = name.removesuffix("weight")
        if symmetric:
            blocks = w.reshape(w.shape[0], -1, group_size).astype(np.float32)  # HF [out, in / G, G]
            scale = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(7.5)
            q = np.clip(np.round(blocks / scale), -8, 7).astype(np.int8).reshape(w.shape)
            dequantized[name] = (q.reshape(blocks.shape) * scale).reshape(w.shape)
            scale = scale[..., 0]
        else:
            q, scale, zero, dequantized[name] = _package_asymmetric(w, group_size)
            tensors[f"{base}weight_zero_point"] = np.ascontiguousarray(
                pack_to_int32(torch.from_numpy(zero), 4, packed_dim=0).numpy()
            )
        packed = pack_to_int32(torch.from_numpy(q), 4).numpy()
        tensors[f"{base}weight_packed"] = np.ascontiguousarray(packed)
        tensors[f"{base}weight_scale"] = np.ascontiguousarray(scale)
        tensors[f"{base}weight_shape"] = np.asarray(w.shape, np.int64)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    weights = dict(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": IGNORED,
    }
    edit_config(out, lambda c: c.update(quantization_config=config))
    return out, dequantized


def _package_asymmetric(w: np.ndarray, group_size: int) -> tuple[np.ndarray, ...]:
    """An HF `[out, in]` weight through the compressed-tensors package's asymmetric group
    quantization: int8 values `[out, in]`, float32 scales and int8 zero points `[out, in / G]`,
    and the package's dequantized weight."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group_size)
    t = torch.from_numpy(np.ascontiguousarray(w, np.float32))
    blocks = t.reshape(t.shape[0], -1, group_size)
    scale, zero = calculate_qparams(blocks.amin(dim=-1), blocks.amax(dim=-1), args)  # [out, in / G]
    q = quantize(t, scale, zero, args, dtype=torch.int8)
    reference = dequantize(q, scale, zero, args, dtype=torch.float32)
    return q.numpy(), scale.numpy(), zero.to(torch.int8).numpy(), reference.numpy()


def package_dequantized(path: str) -> dict[str, np.ndarray]:
    """A symmetric W4A16 checkpoint's weights by HF name (one safetensors file), each 4-bit one
    as the compressed-tensors package unpacks it (`unpack_from_int32`) times its group's scale."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    weights = {}
    for name, value in tensors.items():
        if name.endswith(".weight_packed"):
            base = name.removesuffix("_packed")
            shape = torch.Size(tensors[f"{base}_shape"].tolist())
            q = unpack_from_int32(torch.from_numpy(value), 4, shape).numpy().astype(np.float32)
            scale = tensors[f"{base}_scale"].astype(np.float32)  # [out, in / G]
            weights[base] = q * np.repeat(scale, q.shape[1] // scale.shape[1], axis=1)
        elif not name.endswith(("_scale", "_shape")):
            weights[name] = value
    return weights
