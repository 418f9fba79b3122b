# SPDX-License-Identifier: Apache-2.0
"""4-bit AWQ checkpoints (GEMM layout) of tiny float ones, packed here in NumPy as AutoAWQ writes
them (`awq/utils/packing_utils.py`, read by vLLM's `awq` method):

- min-max quantization over each group of `G` inputs of a column: `scale = (max - min) / 15`,
  zero point `z = round(-min / scale)` in [0, 15], `u = round(w / scale) + z` in [0, 15], the
  weight `(u - z) * scale`;
- `qweight` int32 `[in, out / 8]` and `qzeros` int32 `[in / G, out / 8]`: eight columns a word,
  field i (from the lowest bits) holding column `(0, 2, 4, 6, 1, 3, 5, 7)[i]` of the eight;
- `scales` float16 `[in / G, out]`.

`write_awq` returns the path and the dequantized float32 weights by HF name (the reference
transformers runs)."""

from __future__ import annotations

import os
import re
import shutil

import numpy as np

from tests.models.int4_checkpoints import edit_config

# the projections (Mixtral's experts' w1/w2/w3 too); not lm_head, not a MoE router
# The projections (Qwen3.5's in_proj_qkv / _z / _b / _a too), Mixtral's experts
_QUANTIZED = re.compile(r"(_proj(_qkvz?|_ba|_[zba])?|experts\.[0-9]+\.w[123])\.weight$")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq(values: np.ndarray) -> np.ndarray:
    """`[rows, out]` values in [0, 15] -> int32 `[rows, out / 8]` in AWQ's interleaved order."""
    words = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
    for field, column in enumerate(AWQ_PACK_ORDER):
        words |= values[:, column::8].astype(np.uint32) << np.uint32(4 * field)
    return words.view(np.int32)


def quantize_awq(w: np.ndarray, group_size: int) -> dict[str, np.ndarray]:
    """An HF `[out, in]` float weight as AWQ's three tensors plus its dequantized value."""
    out_features, in_features = w.shape
    blocks = w.T.reshape(in_features // group_size, group_size, out_features).astype(np.float32)
    low, high = blocks.min(axis=1), blocks.max(axis=1)  # [groups, out]
    scale = np.maximum((high - low) / 15, 1e-5).astype(np.float16)
    s = scale.astype(np.float32)
    z = np.clip(np.round(-low / s), 0, 15).astype(np.int32)
    u = np.clip(np.round(blocks / s[:, None, :]) + z[:, None, :], 0, 15).astype(np.int32)
    dequantized = ((u - z[:, None, :]) * s[:, None, :]).reshape(in_features, out_features).T
    return {
        "qweight": pack_awq(u.reshape(in_features, out_features)),
        "qzeros": pack_awq(z),
        "scales": scale,
        "dequantized": dequantized.astype(np.float32),
    }


def write_awq(
    source: str, out: str, *, group_size: int, keep_float: re.Pattern[str] | None = None
) -> tuple[str, dict[str, np.ndarray]]:
    """`source` (a float transformers checkpoint, one safetensors file) as a 4-bit AWQ checkpoint
    at `out`; returns it and the dequantized weights. `keep_float`: the weights (by name) a
    recipe leaves in float."""
    from safetensors.numpy import load_file, save_file

    tensors, dequantized = {}, {}
    for name, w in load_file(os.path.join(source, "model.safetensors")).items():
        if not _QUANTIZED.search(name) or (keep_float is not None and keep_float.search(name)):
            tensors[name] = dequantized[name] = w
            continue
        packed = quantize_awq(w, group_size)
        dequantized[name] = packed.pop("dequantized")
        base = name.removesuffix(".weight")
        tensors |= {f"{base}.{k}": np.ascontiguousarray(v) for k, v in packed.items()}
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }
    edit_config(out, lambda c: c.update(quantization_config=config))
    return out, dequantized
