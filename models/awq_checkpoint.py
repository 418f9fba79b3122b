# SPDX-License-Identifier: Apache-2.0
"""4-bit AWQ checkpoints (`quant_method: "awq"`, GEMM layout), loaded as affine int4 kernels.

Such a model directory's `config.json` holds a `quantization_config` like `{"quant_method":
"awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}`, and each quantized
linear layer `<layer>` holds (AutoAWQ's GEMM layout, as vLLM's `awq` method reads it; `G` the
group size):

- `<layer>.qweight`: int32 `[in, out / 8]`, eight 4-bit unsigned values `u` of one input a word,
  in AWQ's interleaved column order: the word's i-th field (from the lowest bits) holds column
  `AWQ_ORDER[i]` of its eight;
- `<layer>.qzeros`: int32 `[in / G, out / 8]`, the zero points `z`, packed alike;
- `<layer>.scales`: float16 `[in / G, out]`.

The weight is `(u - z) * scale`: loaded as int4 values `u - 8` with float32 scales and offsets
`(8 - z) * scale` per group (`models.int4`: `w = q * s + m`), exactly those weights. Refused by
name: other bit widths, `zero_point: false`, versions other than GEMM (GEMV's layout differs).
MoE experts (Qwen3-30B-A3B-AWQ's, Mixtral's) load alike, each expert's values, scales and offsets
stacked `[E, in, out]` and `[E, in / G, out]` (`models.moe`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
from flax import nnx

from models import int4
from models.compressed_tensors import int8_kernels_for, quantization_config

METHOD = "awq"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of each 4-bit field of a word, lowest first
_COLUMN_FIELDS = np.argsort(AWQ_ORDER)  # the field of each column of a word


def check_config(config: dict) -> None:
    """ValueError naming the field unless `config` is an AWQ config vllm-xla serves."""
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"AWQ checkpoint with bits={bits!r}: vllm-xla loads 4-bit AWQ weights only")
    if not config.get("zero_point", True):
        raise ValueError(
            "AWQ checkpoint with zero_point=false is not supported: AWQ weights have zero points"
        )
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ checkpoint version {version!r}: vllm-xla loads the GEMM layout only")
    size = group_size(config)
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"AWQ checkpoint group_size {size!r} is not a positive number of inputs")


def group_size(config: dict | None) -> int | None:
    """The inputs per scale of an AWQ `config`'s weights (None: not AWQ)."""
    if not config or config.get("quant_method") != METHOD:
        return None
    return config.get("group_size", config.get("q_group_size"))


def unpack_awq(packed: np.ndarray) -> np.ndarray:
    """int32 `[rows, out / 8]` in AWQ's interleaved order -> the unsigned values `[rows, out]`."""
    fields = int4.unpack_unsigned(packed, axis=-1)  # [rows, out], each word's fields in order
    rows, columns = fields.shape
    words = fields.reshape(rows, columns // int4.VALUES_PER_WORD, int4.VALUES_PER_WORD)
    return words[..., _COLUMN_FIELDS].reshape(rows, columns)


@dataclasses.dataclass(frozen=True)
class AwqCheckpoint:
    """An AWQ checkpoint's reading: its HF-name table (ours plus a scale and an offset name per
    linear weight)."""

    param_map: dict[str, str]

    def tensors(self, tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The checkpoint's tensors as int4 `weight` `[out, in]`, float32 `weight_scale` and
        `weight_offset` `[out, in / G]` (HF orientation)."""
        waiting: dict[str, dict[str, np.ndarray]] = {}  # a layer's scales or zero points
        for name, array in tensors:
            if name.endswith(".qweight"):
                values = unpack_awq(np.asarray(array)).astype(np.int8) - int4.OFFSET
                yield name.removesuffix(".qweight") + ".weight", values.astype(int4.INT4_DTYPE).T
            elif name.endswith((".scales", ".qzeros")):
                layer, kind = name.rsplit(".", 1)
                if kind == "scales":
                    yield layer + ".weight_scale", np.asarray(array, np.float32).T
                parts = waiting.setdefault(layer, {})
                parts[kind] = np.asarray(array) if kind == "scales" else unpack_awq(np.asarray(array))
                if len(parts) == 2:
                    yield layer + ".weight_offset", _offset(layer, waiting.pop(layer))
            else:
                yield name, array
        for layer, have in waiting.items():
            raise ValueError(f"the AWQ checkpoint lacks {layer}.{'qzeros' if 'scales' in have else 'scales'}")


def _offset(layer: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    scale, zeros = parts["scales"], parts["qzeros"]
    if zeros.shape != scale.shape:
        raise ValueError(
            f"AWQ tensor {layer}.qzeros holds zero points {zeros.shape}, its scales "
            f"{tuple(scale.shape)}: not one per group and output"
        )
    return int4.affine_from_zero_points(scale, zeros).T


def awq_layout(
    model: nnx.Module,
    path: str,
    names: Callable[[], list[str]],
    our_name: Callable[[str], str | None],
) -> AwqCheckpoint | None:
    """For an AWQ checkpoint at `path` whose tensor names `names()` lists: gives each layer it
    quantized int4 zeros (held as `int4.held_dtype`), a scale and an offset (in place, before
    loading) and returns how to read it; None for any other checkpoint."""
    config = quantization_config(path)
    if not config or config.get("quant_method") != METHOD:
        return None
    check_config(config)
    quantized = {n.removesuffix(".qweight") + ".weight" for n in names() if n.endswith(".qweight")}
    param_map = int8_kernels_for(
        model,
        quantized,
        our_name,
        path,
        group_size(config),
        int4.held_dtype(),
        experts_grouped=True,
        offsets=True,
    )
    return AwqCheckpoint(param_map)
