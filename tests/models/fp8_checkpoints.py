# SPDX-License-Identifier: Apache-2.0
"""FP8 checkpoints of tiny float ones, for the tests: compressed-tensors FP8 written by the
compressed-tensors package itself (its schemes applied to the transformers model, its
`ModelCompressor` compressing and saving), and `quant_method: fp8` block checkpoints (the layout
transformers' finegrained-fp8 integration and vLLM's fp8 method read) packed here. Each writer
returns the path; `dequantized_weights` reads any of them back as float32 weights by HF name
(values times their scales, in NumPy), which transformers then runs as the reference."""

from __future__ import annotations

import json
import os
import re
import shutil

import ml_dtypes
import numpy as np

BLOCK = 128  # the block fp8 checkpoints' [outputs, inputs] block side
_FP8_MAX = 448.0
# What recipes quantize: the projections (experts' too); not lm_head, not a MoE router.
# DeepSeek's kv_a_proj_with_mqa too, as released; Qwen3-Next's and Qwen3.5's linear-attention inputs
_QUANTIZED = re.compile(r"_proj(_with_mqa|_qkvz?|_ba|_[zba])?\.weight$")


def write_compressed_fp8(
    source: str,
    out: str,
    scheme: str,
    *,
    model_class: str = "AutoModelForCausalLM",
    ignore: tuple[str, ...] = ("lm_head", "re:.*mlp.gate$"),
) -> str:
    """`source` (a float transformers checkpoint) as a compressed-tensors FP8 checkpoint at `out`:
    `scheme` one of the package's presets, "FP8_DYNAMIC" (a scale per channel, dynamic
    activations), "FP8" (per tensor, static activation scales) or "FP8_BLOCK" (128x128 blocks).
    The scales are each weight's own absolute maximum over 448 (what a min-max observer finds;
    no calibration data), a static scheme's activation scales a constant (never used here).
    `model_class`: the transformers class that loads `source`; `ignore`: the recipe's modules
    left in float."""
    import torch
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    model = getattr(transformers, model_class).from_pretrained(source, dtype=torch.float32)
    scheme_ = preset_name_to_scheme(scheme, ["Linear"])
    config = QuantizationConfig(config_groups={"group_0": scheme_}, ignore=list(ignore))
    apply_quantization_config(model, config)
    with torch.no_grad():
        for _, module in model.named_modules():
            if hasattr(module, "weight_scale"):
                scale = module.weight_scale
                scale.copy_(torch.from_numpy(_amax(module.weight.numpy(), tuple(scale.shape)) / _FP8_MAX))
                if hasattr(module, "input_scale"):
                    module.input_scale.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    _copy_tokenizer(source, out)
    return out


def _amax(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`|w|`'s maximum over each region a scale of `shape` covers (tensor, row or block)."""
    w = np.abs(w.astype(np.float32))
    if int(np.prod(shape)) == 1:
        return np.full(shape, w.max(), np.float32)
    if shape == (w.shape[0], 1):
        return w.max(axis=1, keepdims=True)
    rows, cols = shape
    padded = np.zeros((rows * BLOCK, cols * BLOCK), np.float32)
    padded[: w.shape[0], : w.shape[1]] = w
    return padded.reshape(rows, BLOCK, cols, BLOCK).max(axis=(1, 3))


def write_block_fp8(
    source: str, out: str, *, activation_scheme: str = "dynamic", ignored: tuple[str, ...] = ()
) -> str:
    """`source` as a `quant_method: fp8` checkpoint with `weight_block_size: [128, 128]` at `out`:
    each projection's float8_e4m3fn `weight` and its `weight_scale_inv [ceil(out / 128), in /
    128]` (a block's maximum over 448: the scale the values are multiplied by). `ignored`: the
    modules the recipe leaves in float, listed in the config's `ignored_layers`."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    for file in _files(source):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                w = f.get_tensor(name)
                if not _QUANTIZED.search(name) or name.removesuffix(".weight") in ignored:
                    tensors[name] = w
                    continue
                rows, cols = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
                scale = np.maximum(_amax(w.numpy(), (rows, cols)), 1e-12) / _FP8_MAX
                full = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[: w.shape[0], : w.shape[1]]
                q = np.clip(w.numpy() / full, -_FP8_MAX, _FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
                tensors[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
                tensors[f"{name}_scale_inv"] = torch.from_numpy(scale.astype(np.float32))
                if activation_scheme == "static":
                    tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.05)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    config = _block_config(activation_scheme) | ({"ignored_layers": list(ignored)} if ignored else {})
    _edit_config(out, lambda c: c.update(quantization_config=config))
    return out


def _block_config(activation_scheme: str) -> dict:
    return {
        "quant_method": "fp8",
        "activation_scheme": activation_scheme,
        "fmt": "e4m3",
        "weight_block_size": [BLOCK, BLOCK],
    }


def dequantized_weights(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the fp8 checkpoint at `path` as float32 by HF name, each fp8 weight times
    its scale (per tensor, row or block, whichever it holds); scale tensors left out."""
    from safetensors import safe_open

    raw = {}
    for file in _files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                raw[name] = t.float().numpy()
    weights = {}
    for name, value in raw.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        scale = raw.get(f"{name}_scale", raw.get(f"{name}_scale_inv"))
        weights[name] = value if scale is None else value * _expanded(scale, value.shape)
    return weights


def _expanded(scale: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A scale of a weight of `shape` broadcast to it: per tensor, per row `[out, 1]`, or blocks."""
    if scale.size == 1 or scale.shape == (shape[0], 1):
        return scale.reshape(-1, 1) if scale.size > 1 else scale.reshape(())
    return np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[: shape[0], : shape[1]]


def write_float(source: str, out: str, weights: dict[str, np.ndarray]) -> str:
    """`source`'s config and tokenizer with `weights` (float32, HF names) as its safetensors."""
    from safetensors.numpy import save_file

    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(
        {k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()},
        os.path.join(out, "model.safetensors"),
    )
    _edit_config(out, lambda c: c.pop("quantization_config", None))
    return out


def _files(path: str) -> list[str]:
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))


def _edit_config(path: str, edit) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    edit(config)
    with open(file, "w") as f:
        json.dump(config, f)


def _copy_tokenizer(source: str, out: str) -> None:
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens")) and not os.path.exists(os.path.join(out, name)):
            shutil.copy(os.path.join(source, name), out)
