# SPDX-License-Identifier: Apache-2.0
"""fp8 weights (W8A16): float8_e4m3fn values with a float32 scale per output channel or per
group of inputs of each channel, in the same two layouts as int8's (`models.int8`).

A kernel `[..., in, out]` is stored as e4m3 values `q` and a float32 scale `s` with `w ~ q * s`,
`s = max|w| / 448` (448: e4m3's largest finite value), `q = w / s` rounded to nearest e4m3 (3
significant bits; values beyond the range are clipped first, since a cast of one is NaN). The
scale layouts are int8's: `[..., out]` per channel, `[..., in / G, out]` per group of `G`
inputs of each column. A checkpoint's 128x128 block scales (`quant_method: fp8` with
`weight_block_size`, DeepSeek-V3 and Qwen3-FP8: `weight_scale_inv [out / 128, in / 128]`) are
held grouped, one scale per 128 inputs of each column (`block_scales`): each block's scale
repeated over its 128 columns. That costs 4 bytes per 128 weights (3% beside the fp8 bytes)
where the block layout costs 4 per 16,384, and in return every fp8 kernel runs through the one
scaled dot, fused projections concatenate their scales like their columns, and a tensor-parallel
split of the outputs may cut a block anywhere (each column carries its own scales).

The product is int8's (`models.int8.int8_dot`): every e4m3 value is exact in bfloat16, so the
values are converted to the activations' dtype inside the dot (XLA fuses the convert into the
dot's operand on TPU and GPU: the weights cross memory as fp8) and the scale multiplies the
float32 product. Activations stay in the model's dtype, a W8A8 checkpoint's too.

The functions take NumPy arrays (on the host at load) or JAX arrays and tracers alike.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from models.int8 import SCALE_DTYPE, _xp
from models.int8 import dequantize as dequantize  # the same product of values and scales

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


def is_fp8(dtype) -> bool:
    """Whether `dtype` is the fp8 weights' dtype (float8_e4m3fn)."""
    return np.dtype(dtype) == FP8_DTYPE


def quantize_grouped(kernel, group_size: int) -> tuple:
    """`kernel [..., in, out]` -> e4m3 `q [..., in, out]`, float32 `s [..., in / G, out]`: one
    scale per column for each `group_size` consecutive inputs (`in` must be a multiple of it). An
    all-zero group gets scale 1."""
    *lead, inputs, outputs = kernel.shape
    if group_size < 1 or inputs % group_size:
        raise ValueError(f"a kernel of {inputs} inputs does not split into groups of {group_size}")
    xp = _xp(kernel)
    w = kernel.astype(np.float32).reshape(*lead, inputs // group_size, group_size, outputs)
    amax = xp.max(xp.abs(w), axis=-2, keepdims=True)
    scale = xp.where(amax > 0, amax / FP8_MAX, np.float32(1)).astype(SCALE_DTYPE)
    q = xp.clip(w / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q.reshape(kernel.shape), scale[..., 0, :]


def quantize_per_channel(kernel) -> tuple:
    """`kernel [..., in, out]` -> e4m3 `q [..., in, out]`, float32 `s [..., out]` (one group of
    every input)."""
    q, scale = quantize_grouped(kernel, kernel.shape[-2])
    return q, scale[..., 0, :]


def quantize(kernel, group_size: int | None = None) -> tuple:
    """`quantize_grouped` with `group_size`, else `quantize_per_channel`."""
    return quantize_per_channel(kernel) if group_size is None else quantize_grouped(kernel, group_size)


def block_scales(
    scale_inv: np.ndarray, weight_shape: tuple[int, int], block: tuple[int, int], name: str
) -> np.ndarray:
    """A block-fp8 checkpoint's `weight_scale_inv [ceil(out / Bo), ceil(in / Bi)]` for a weight
    `[out, in]` (HF orientation) -> the scale per group of `Bi` inputs of each output row,
    `[out, in / Bi]` (HF orientation, as a grouped checkpoint's `weight_scale`): each block's
    scale repeated over its `Bo` rows, the last block's trimmed to the rows there are. A weight
    whose inputs end inside a block is refused (its last group would be short)."""
    out_features, in_features = weight_shape
    block_out, block_in = block
    if in_features % block_in:
        raise ValueError(
            f"checkpoint tensor {name!r} has {in_features} inputs, which end inside a "
            f"{block_in}-input block of its fp8 scales; vllm-xla loads block fp8 weights whose "
            "inputs are whole blocks"
        )
    expected = (-(-out_features // block_out), in_features // block_in)
    scale_inv = np.asarray(scale_inv, np.float32)
    if scale_inv.shape != expected:
        raise ValueError(
            f"checkpoint tensor {name!r}_scale_inv has shape {scale_inv.shape}; a weight "
            f"{weight_shape} in {block_out}x{block_in} blocks has {expected}"
        )
    return np.repeat(scale_inv, block_out, axis=0)[:out_features]
