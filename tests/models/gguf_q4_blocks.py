# SPDX-License-Identifier: Apache-2.0
"""GGUF 4-bit blocks for test files: Q4_0 and Q4_1 from the `gguf` package's quantizer, Q4_K
(which it does not write) packed here in NumPy as ggml lays it out (`block_q4_K`): super-blocks
of 256 inputs, each a float16 `d` and `dmin`, twelve bytes of eight 6-bit sub-block scales `sc`
and minimums `mn`, and 128 bytes of 4-bit values `u` (bytes `32 j .. 32 j + 31` hold sub-block
`2 j` in their low nibbles and `2 j + 1` in their high ones); `w = d * sc * u - dmin * mn`. The
tests check the packing against the `gguf` package's dequantization."""

from __future__ import annotations

import gguf
import numpy as np

Q4_TYPES = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_K)


def quantizer(kind: gguf.GGMLQuantizationType):
    """`w [out, in]` -> (raw blocks, `kind`), for `write_q8_0_gguf(quantize=...)`."""
    if kind == gguf.GGMLQuantizationType.Q4_K:
        return lambda w: (pack_q4_k(w), kind)
    return lambda w: (gguf.quants.quantize(w, kind), kind)


def pack_q4_k(w: np.ndarray) -> np.ndarray:
    """`w [rows, in]` (in a multiple of 256) as Q4_K bytes `[rows, in / 256 * 144]`: min-max per
    sub-block of 32, its scale and minimum quantized to 6 bits against the super-block's."""
    rows = w.shape[0]
    sub = w.astype(np.float32).reshape(rows, -1, 8, 32)  # [rows, super-blocks, 8, 32]
    low = np.minimum(sub.min(axis=-1), 0)
    step, lift = (sub.max(axis=-1) - low) / 15, -low  # [rows, n, 8]
    d = (np.maximum(step.max(axis=-1), 1e-6) / 63).astype(np.float16)
    dmin = (np.maximum(lift.max(axis=-1), 1e-6) / 63).astype(np.float16)
    sc = np.clip(np.round(step / d.astype(np.float32)[..., None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(lift / dmin.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * mn
    u = np.clip(np.round((sub + offset[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    packed = np.concatenate(
        [
            (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
            (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )  # [rows, n, 12]
    qs = (u[..., 0::2, :] | (u[..., 1::2, :] << 4)).reshape(*u.shape[:2], 128)
    halves = np.stack([d, dmin], axis=-1).view(np.uint8)  # [rows, n, 4]
    return np.concatenate([halves, packed, qs], axis=-1).reshape(rows, -1)
