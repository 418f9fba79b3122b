# SPDX-License-Identifier: Apache-2.0
"""Checkpoint layers that hold several of a model's projections side by side on their outputs
(Qwen3.5's `linear_attn.in_proj_qkv`: q, k and v), taken apart on load in the layout each of
their tensors has, before the checkpoint format's reader (`models.compressed_tensors`,
`fp8_checkpoint`, `gptq_checkpoint`, `awq_checkpoint`) sees them, so that it reads each part as
the layer it would hold alone.

A model lists such layers (`fused_outputs`: `FusedOutputs`, the layer's name and its parts'
names and output widths). Each tensor of the layer is cut on the axis that holds its outputs,
in the units it holds them in (`OutputUnits.place`, from the checkpoint's `quantization_config`):

- a float, fp8 or int8 `weight [out, in]`, compressed-tensors' `weight_packed [out, in / 8]`,
  per-channel or grouped scales (`weight_scale [out, 1]`, `[out, in / G]`), unpacked int8
  zero points and a `bias [out]`: axis 0, one output an entry;
- compressed-tensors' packed zero points (`weight_zero_point [ceil(out / 8), in / G]`, int32):
  axis 0, eight outputs a word;
- block fp8 scales (`quant_method: fp8`'s `weight_scale_inv`, a compressed-tensors `block`
  group's `weight_scale`, `[ceil(out / Bo), in / Bi]`): axis 0, `Bo` outputs an entry;
- GPTQ's `qweight [in / 8, out]` and `scales [in / G, out]`, AWQ's `scales`: the last axis, one
  output an entry; GPTQ's and AWQ's `qzeros [in / G, out / 8]` and AWQ's `qweight [in, out /
  8]`: the last axis, eight outputs a word;
- taken whole by every part: a per-tensor scale (one value), `input_scale`, GPTQ's `g_idx` (a
  group an input: the parts share their inputs); compressed-tensors' `weight_shape` becomes each
  part's own `[width, in]`.

A part whose width is not a whole number of those units (a q, k or v width that is not a
multiple of the fp8 block, or of eight for packed outputs) cannot be cut from the tensor and is
refused by name, with the tensor, the widths and the unit; so is a tensor whose outputs are not
the parts' sum.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from models import awq_checkpoint, compressed_tensors, fp8_checkpoint, gptq_checkpoint

# Tensors every part takes as they are: activation scales and GPTQ's group of each input.
_WHOLE = ("input_scale", "g_idx")
_PACKED = 8  # outputs an int32 word of 4-bit values
_SHAPE = "weight_shape"


@dataclasses.dataclass(frozen=True)
class FusedOutputs:
    """A checkpoint layer (`layer`: its name without the layer's prefix, e.g.
    `.linear_attn.in_proj_qkv`) holding the projections `parts` (named alike) of `widths`
    outputs, side by side in that order."""

    layer: str
    parts: tuple[str, ...]
    widths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.parts) != len(self.widths) or min(self.widths, default=0) < 1:
            raise ValueError(f"fused layer {self.layer!r}: parts {self.parts} need one positive width each")

    def parse(self, name: str) -> tuple[str, str] | None:
        """`(prefix, kind)` of a tensor `<prefix><layer>.<kind>` of this layer, else None."""
        prefix, found, kind = name.partition(f"{self.layer}.")
        return (prefix, kind) if found and kind and "." not in kind else None

    def part_names(self, prefix: str, kind: str) -> list[str]:
        return [f"{prefix}{part}.{kind}" for part in self.parts]


@dataclasses.dataclass(frozen=True)
class OutputUnits:
    """Where a checkpoint format's tensors of a linear layer hold its outputs (module docstring):
    `block`, the outputs of a block of fp8 scales (None: not block fp8); `columns`, the method
    whose tensors hold outputs on their last axis ("gptq", "awq"; None: on the first)."""

    block: int | None = None
    columns: str | None = None

    def place(self, kind: str, array: Any) -> tuple[int, int] | None:
        """`(axis, outputs an entry)` of a tensor of `kind` (its name's last part); None when
        every part takes it whole."""
        array = np.asarray(array)
        if kind in _WHOLE or (kind.startswith("weight_scale") and array.size == 1):
            return None
        if self.columns is not None and kind in ("qweight", "qzeros", "scales"):
            packed = kind == "qzeros" or (kind == "qweight" and self.columns == awq_checkpoint.METHOD)
            return array.ndim - 1, _PACKED if packed else 1
        if self.block is not None and kind in ("weight_scale", "weight_scale_inv"):
            return 0, self.block
        if kind == "weight_zero_point" and array.dtype == np.int32:
            return 0, _PACKED
        return 0, 1


def output_units(config: dict | None) -> OutputUnits:
    """The `OutputUnits` of a checkpoint whose `quantization_config` is `config` (None: float)."""
    method = (config or {}).get("quant_method")
    if method in (gptq_checkpoint.METHOD, awq_checkpoint.METHOD):
        return OutputUnits(columns=method)
    block = fp8_checkpoint.block_of(config) or compressed_tensors.block_of(config)
    return OutputUnits(block=block[0] if block else None)


def split_names(names: Iterable[str], layers: tuple[FusedOutputs, ...]) -> Iterator[str]:
    """`names` with each tensor of a fused layer as its parts' (the same kind of tensor)."""
    for name in names:
        yield from _parts_of(name, layers) or [name]


def _parts_of(name: str, layers: tuple[FusedOutputs, ...]) -> list[str]:
    for layer in layers:
        parsed = layer.parse(name)
        if parsed is not None:
            return layer.part_names(*parsed)
    return []


def split_tensors(
    tensors: Iterator[tuple[str, Any]], layers: tuple[FusedOutputs, ...], units: OutputUnits
) -> Iterator[tuple[str, Any]]:
    """`tensors` with each tensor of a fused layer cut into its parts' (`split_tensor`)."""
    for name, array in tensors:
        for layer in layers:
            parsed = layer.parse(name)
            if parsed is not None:
                yield from split_tensor(name, array, layer, units)
                break
        else:
            yield name, array


def split_tensor(name: str, array: Any, layer: FusedOutputs, units: OutputUnits) -> list[tuple[str, Any]]:
    """The parts of tensor `name` of `layer` (module docstring), by their names."""
    prefix, kind = layer.parse(name) or ("", "")
    names = layer.part_names(prefix, kind)
    if kind == _SHAPE:  # compressed-tensors' `[out, in]` of the packed weight
        shape = np.asarray(array)
        inputs = int(shape.reshape(-1)[-1])
        return [(n, np.asarray([w, inputs], shape.dtype)) for n, w in zip(names, layer.widths, strict=True)]
    place = units.place(kind, array)
    if place is None:
        return [(n, array) for n in names]
    axis, unit = place
    widths = layer.widths
    if any(w % unit for w in widths):
        raise ValueError(
            f"checkpoint tensor {name!r} holds {len(widths)} projections of {list(widths)} outputs "
            f"side by side, {unit} outputs an entry of its axis {axis} (an fp8 scale block's "
            "rows, or a word of packed 4-bit values): widths that are not multiples of "
            f"{unit} cannot be cut apart; vllm-xla loads such a layer quantized with whole "
            "blocks (or words) a part, or left in float"
        )
    array = np.asarray(array)
    entries = -(-sum(widths) // unit)
    if array.ndim == 0 or array.shape[axis] != entries:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {array.shape}; its {len(widths)} projections of "
            f"{list(widths)} outputs take {entries} entries ({unit} outputs each) on its axis {axis}"
        )
    bounds = np.cumsum([w // unit for w in widths])[:-1]
    return list(zip(names, np.split(array, bounds, axis=axis), strict=True))


def named_as_checkpoint(error: ValueError, layers: tuple[FusedOutputs, ...]) -> ValueError:
    """`error` (raised while reading the parts of a fused layer) with the checkpoint tensor each
    part it names was cut from: a user searching the file finds `in_proj_qkv`, not our `in_proj_q`."""
    message = str(error)
    sources = {}
    for layer in layers:
        for part in layer.parts:
            for prefix, kind in re.findall(rf"([\w.]*?){re.escape(part)}\.(\w+)", message):
                sources[f"{prefix}{part}.{kind}"] = f"{prefix}{layer.layer}.{kind}"
    if not sources:
        return error
    cuts = "; ".join(f"{part} is cut from the checkpoint's {whole}" for part, whole in sources.items())
    return ValueError(f"{message} ({cuts}: vllm-xla reads that fused layer as its parts)")
