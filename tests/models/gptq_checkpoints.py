# SPDX-License-Identifier: Apache-2.0
"""4-bit GPTQ checkpoints of tiny float ones, packed here in NumPy in the layout vLLM's
`auto_gptq` method reads (`vllm/model_executor/layers/quantization/auto_gptq.py`):

- `qweight` int32 `[in / 8, out]`: the quantized values `q = round(w / s) + 8` in [0, 15]
  (`uint4b8`), eight consecutive inputs a word, the first in the lowest 4 bits;
- `scales` float16 `[in / G, out]`: `max|w| / 7.5` over each group of G inputs of a column (the
  largest magnitude lands on -8 or 7, as a symmetric min-max quantizer puts it);
- `qzeros` int32 `[in / G, out / 8]`: every zero point 8, stored as 7 (the original GPTQ format
  stores zero points minus one), eight columns a word;
- `g_idx` int32 `[in]`: `i // G`, consecutive groups (desc_act false); with activation order
  (desc_act true) each input's group in a random order of the inputs (`act_order_g_idx`): the
  inputs `perm[j G .. (j + 1) G - 1]` form group j, as GPTQ assigns them after sorting the inputs
  by its Hessian's diagonal, and `qweight` keeps the inputs in their own order; the weight is
  the format's `(q - z[g_idx]) * s[g_idx]` per input row.

`write_gptq` returns the path and the dequantized float32 weights by HF name (`(q - 8) * s`,
the reference transformers runs)."""

from __future__ import annotations

import os
import re
import shutil
import zlib

import numpy as np

from tests.models.int4_checkpoints import edit_config

# The projections (Qwen3.5's in_proj_qkv / _z / _b / _a too); not lm_head, not a MoE router
_QUANTIZED = re.compile(r"_proj(_qkvz?|_ba|_[zba])?\.weight$")
_SAME_INPUTS = re.compile(r"(q|k|v|gate|up)_proj")


def pack_columns_of_eight(values: np.ndarray, axis: int) -> np.ndarray:
    """Values in [0, 15] -> int32 words of eight consecutive ones along `axis`, the first lowest."""
    moved = np.moveaxis(values.astype(np.uint32), axis, -1)
    fields = moved.reshape(*moved.shape[:-1], -1, 8) << (np.arange(8, dtype=np.uint32) * 4)
    words = np.bitwise_or.reduce(fields, axis=-1).view(np.int32)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis))


def act_order_g_idx(in_features: int, group_size: int | None, seed: int) -> np.ndarray:
    """A desc_act checkpoint's `g_idx`: group `j` holds the inputs `perm[jG:(j+1)G]` of a random
    permutation `perm`."""
    size = group_size or in_features
    perm = np.random.default_rng(seed).permutation(in_features)
    g_idx = np.empty(in_features, np.int32)
    g_idx[perm] = np.arange(in_features) // size
    return g_idx


def quantize_gptq(
    w: np.ndarray, group_size: int | None, *, sym: bool = True, g_idx: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """An HF `[out, in]` float weight as GPTQ's four tensors plus its dequantized value. `sym`
    false: min-max over each group, `scale = (max - min) / 15`, zero point `z = round(-min /
    scale)` in [1, 15] (the original format stores `z - 1`, so 0 is not storable), `u =
    round(w / scale) + z` in [0, 15], the weight `(u - z) * scale`. `g_idx`: each input's group
    (activation order), else `i // G`; the dequantized weight is the format's reference
    `(u[i] - z[g_idx[i]]) * s[g_idx[i]]` for input row i."""
    out_features, in_features = w.shape
    size = group_size or in_features
    if g_idx is None:
        g_idx = (np.arange(in_features) // size).astype(np.int32)
    order = np.argsort(g_idx, kind="stable")  # each group's inputs together, groups in order
    rows = w.T[order].astype(np.float32)
    blocks = rows.reshape(in_features // size, size, out_features)  # [groups, G, out]
    if sym:
        scale = (np.abs(blocks).max(axis=1) / 7.5).astype(np.float16)  # [groups, out]
        z = np.full(scale.shape, 8, np.int32)
    else:
        low, high = np.minimum(blocks.min(axis=1), 0), np.maximum(blocks.max(axis=1), 0)
        scale = ((high - low) / 15).astype(np.float16)
        z = np.clip(np.round(-low / np.maximum(scale.astype(np.float32), 1e-8)), 1, 15).astype(np.int32)
    s = np.maximum(scale.astype(np.float32), np.float32(1e-8))[:, None, :]
    grouped = np.clip(np.round(blocks / s) + z[:, None, :], 0, 15).astype(np.int32)  # [groups, G, out]
    q = np.empty((in_features, out_features), np.int32)
    q[order] = grouped.reshape(in_features, out_features)  # back in the inputs' own order
    dequantized = ((q - z[g_idx]) * scale.astype(np.float32)[g_idx]).T  # the format's reference
    zeros = z - 1
    return {
        "qweight": pack_columns_of_eight(q, axis=0),
        "scales": scale,
        "qzeros": pack_columns_of_eight(zeros, axis=1),
        "g_idx": np.asarray(g_idx, np.int32),
        "dequantized": dequantized.astype(np.float32),
    }


def write_gptq(
    source: str,
    out: str,
    *,
    group_size: int | None,
    sym: bool = True,
    act_order: int | None = None,
    keep_float: re.Pattern[str] | None = None,
) -> tuple[str, dict[str, np.ndarray]]:
    """`source` (a float transformers checkpoint, one safetensors file) as a 4-bit GPTQ checkpoint
    at `out` (`group_size` None: `-1`, per channel); returns it and the dequantized weights.
    `act_order` (a seed): desc_act true, every projection's groups in a random order of its
    inputs (`act_order_g_idx`), one order for the projections that read the same inputs (q/k/v,
    gate/up), except o_proj's, left in the trivial order. `keep_float`: the weights (by name) a
    recipe leaves in float."""
    from safetensors.numpy import load_file, save_file

    tensors, dequantized = {}, {}
    for name, w in load_file(os.path.join(source, "model.safetensors")).items():
        if not _QUANTIZED.search(name) or (keep_float is not None and keep_float.search(name)):
            tensors[name] = dequantized[name] = w
            continue
        g_idx = None
        if act_order is not None and not name.endswith("o_proj.weight"):
            inputs = _SAME_INPUTS.sub("in", name)  # q/k/v alike, gate/up alike
            g_idx = act_order_g_idx(w.shape[1], group_size, act_order + zlib.crc32(inputs.encode()))
        packed = quantize_gptq(w, group_size, sym=sym, g_idx=g_idx)
        dequantized[name] = packed.pop("dequantized")
        base = name.removesuffix(".weight")
        tensors |= {f"{base}.{k}": np.ascontiguousarray(v) for k, v in packed.items()}  # memory order
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size or -1,
        "desc_act": act_order is not None,
    }
    edit_config(out, lambda c: c.update(quantization_config={**config, "sym": sym}))
    return out, dequantized
