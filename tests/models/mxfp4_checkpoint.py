# SPDX-License-Identifier: Apache-2.0
"""Tiny GPT-OSS checkpoints with mxfp4 experts, as the released ones are laid out, for tests.

`pack_mxfp4` is a small NumPy encoder of the format (`models.mxfp4`): per 32 inputs of each
output row, the e8m0 scale is the power of two putting the block's largest magnitude in
`(3, 6]` (FP4's top binade; 6 = 1.5 * 2**2), every value is rounded to the nearest FP4 value
after dividing by it, and two 4-bit codes (sign bit, then the index of the magnitude in
0, 0.5, 1, 1.5, 2, 3, 4, 6) share a byte, the even input in the low nibble.

`save_tiny_gpt_oss_mxfp4` writes two directories from one random tiny GPT-OSS: the mxfp4 one
(experts as `*_blocks`/`*_scales`, `quantization_config.quant_method: mxfp4`) and its
dequantized float32 twin, whose experts transformers' own `convert_moe_packed_tensors` decodes
from those blocks and scales: the independent reference a served mxfp4 model must equal.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from tests.models.tiny_checkpoints import save_tiny

BLOCK = 32
_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def pack_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`weight [.., out, in]` -> blocks `[.., out, in / 32, 16]` uint8, scales `[.., out, in / 32]` uint8."""
    *lead, inputs = weight.shape
    groups = weight.reshape(*lead, inputs // BLOCK, BLOCK).astype(np.float32)
    amax = np.max(np.abs(groups), axis=-1)
    exponent = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    scaled = groups / np.exp2(exponent)[..., None]
    index = np.argmin(np.abs(np.abs(scaled)[..., None] - _MAGNITUDES), axis=-1)  # [.., G, 32]
    codes = (index | np.where(scaled < 0, 8, 0)).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # C order: safetensors' NumPy writer stores an array's buffer as it is laid out.
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exponent + 127, np.uint8)


def transformers_dequantized(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' `convert_moe_packed_tensors` (float32) of an expert stack: `[E, in, out]`."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    return out.numpy()


def save_tiny_gpt_oss_mxfp4(path: str, *, seed: int = 0, **overrides) -> tuple[str, str]:
    """A tiny random GPT-OSS in mxfp4 at `path/mxfp4` and its dequantized twin at
    `path/dequantized`; returns both paths. The experts' F defaults to 64 (two blocks of 32: a
    TP of 2 splits down's inputs on a block boundary)."""
    from safetensors.numpy import load_file, save_file

    source, mxfp4, dequantized = (os.path.join(path, name) for name in ("float", "mxfp4", "dequantized"))
    save_tiny("GptOssForCausalLM", source, seed=seed, **{"intermediate_size": 64, **overrides})
    tensors = load_file(os.path.join(source, "model.safetensors"))
    packed, twin = {}, {}
    for name, value in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = pack_mxfp4(np.swapaxes(value, 1, 2))  # our [E, in, out] -> [E, out, in]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            twin[name] = np.ascontiguousarray(transformers_dequantized(blocks, scales))
        else:
            packed[name] = twin[name] = value
    for directory, weights, quantized in ((mxfp4, packed, True), (dequantized, twin, False)):
        shutil.copytree(source, directory)
        save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        config_file = os.path.join(directory, "config.json")
        with open(config_file) as f:
            config = json.load(f)
        if quantized:
            config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
        with open(config_file, "w") as f:
            json.dump(config, f)
    return mxfp4, dequantized
