# SPDX-License-Identifier: Apache-2.0
"""4-bit GPTQ checkpoints (`quant_method: "gptq"`), loaded as they are as int4 kernels (`models.int4`).

Such a model directory's `config.json` holds a `quantization_config` like `{"quant_method":
"gptq", "bits": 4, "group_size": 128, "desc_act": false, "sym": true}`, and each quantized
linear layer `<layer>` holds (vLLM's `auto_gptq` layout, `G` the group size, all inputs when
`group_size` is -1):

- `<layer>.qweight`: int32 `[in / 8, out]`, eight 4-bit values of consecutive inputs a word, the
  first in the lowest bits, each stored plus 8 (`uint4b8`): the weight is `(stored - 8) * scale`;
- `<layer>.scales`: float16 `[in / G, out]`, one per group of `G` consecutive inputs and output;
- `<layer>.qzeros`: int32 `[in / G, out / 8]`, the zero points, eight output columns a word:
  a symmetric checkpoint's are all 8, which vLLM's kernels do not read either (dropped); an
  asymmetric one's (`sym: false`) are read: the original format (`checkpoint_format` "gptq", the
  default) stores each zero point minus one, "gptq_v2" as it is (as vLLM's GPTQ kernels read
  them), and the weight is `(stored - z) * scale`;
- `<layer>.g_idx`: int32 `[in]`, each input's group: `i // G` without activation reordering
  (checked, then dropped).

The stored values minus 8 are int4 as they stand, so a layer loads as int4 values `[in, out]`
with float32 scales `[in / G, out]` (`[out]` per channel), exactly the weights vLLM computes
with; an asymmetric checkpoint's also with float32 offsets `(8 - z) * scale` in the scales'
layout (`models.int4`: `w = q * s + m`). Refused by name: other bit widths (GPTQ's 8-bit and
2/3-bit), activation reordering (`desc_act: true`, or a `g_idx` that is not `i // G`), a
quantized head (`lm_head: true`), per-module `dynamic` overrides, and an asymmetric MoE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
from flax import nnx

from models import int4
from models.compressed_tensors import int8_kernels_for, quantization_config

METHOD = "gptq"
_SUFFIXES = (".qweight", ".scales", ".qzeros", ".g_idx")
_FORMATS = ("gptq", "gptq_v2")  # v1 stores zero points minus one


def check_config(config: dict) -> None:
    """ValueError naming the field unless `config` is a GPTQ config vllm-xla serves."""
    bits, sym = config.get("bits"), config.get("sym", True)
    if bits != 4:
        raise ValueError(
            f"GPTQ checkpoint with bits={bits!r}: vllm-xla loads 4-bit GPTQ weights only (for 8-bit "
            "weights use an int8 compressed-tensors checkpoint, or --quantization "
            "int8_per_channel_weight_only on the float model)"
        )
    if not isinstance(sym, bool):
        raise ValueError(f"GPTQ checkpoint with sym={sym!r}: it is true (symmetric) or false (zero points)")
    if config.get("checkpoint_format", "gptq") not in _FORMATS:
        raise ValueError(
            f"GPTQ checkpoint_format {config.get('checkpoint_format')!r} is not one of {_FORMATS}"
        )
    if config.get("desc_act"):
        raise ValueError(
            "GPTQ checkpoint with desc_act=true (activation reordering, act-order): vllm-xla loads "
            "GPTQ weights whose groups are consecutive inputs only; use a desc_act=false checkpoint"
        )
    size = config.get("group_size", -1)
    if not isinstance(size, int) or (size != -1 and size < 1):
        raise ValueError(f"GPTQ checkpoint group_size {size!r} is neither -1 (per channel) nor positive")
    if config.get("lm_head"):
        raise ValueError("GPTQ checkpoint with a quantized head (lm_head=true) is not supported")
    if config.get("dynamic"):
        raise ValueError(
            "GPTQ checkpoint with per-module `dynamic` overrides is not supported: vllm-xla loads "
            "one bit width and group size a model"
        )


def group_size(config: dict | None) -> int | None:
    """The inputs per scale of a GPTQ `config`'s weights: None per channel (or not GPTQ)."""
    if not config or config.get("quant_method") != METHOD:
        return None
    size = config.get("group_size", -1)
    return None if size == -1 else size


@dataclasses.dataclass(frozen=True)
class GptqCheckpoint:
    """A GPTQ checkpoint's reading: its HF-name table (ours plus one scale name per linear
    weight, and an offset name when asymmetric), its group size (None: per channel), and for an
    asymmetric one what its stored zero points lack (1 in the original format, 0 in v2)."""

    param_map: dict[str, str]
    group_size: int | None
    zero_shift: int | None = None  # None: symmetric, zero points dropped

    def tensors(self, tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The checkpoint's tensors as plain int4 `weight` `[out, in]` and float32 `weight_scale`
        (`[out, in / G]`, or `[out]` per channel: HF orientation); `g_idx` checked and dropped;
        `qzeros` dropped when symmetric, else with the scales as float32 `weight_offset` (the
        scales' layout)."""
        waiting: dict[str, dict[str, np.ndarray]] = {}  # an asymmetric layer's scales or zeros
        for name, array in tensors:
            if name.endswith(".qweight"):
                yield name.removesuffix(".qweight") + ".weight", int4.unpack_int32(array, axis=0).T
            elif name.endswith(".scales"):
                yield name.removesuffix(".scales") + ".weight_scale", self._hf_layout(array)
                if self.zero_shift is not None:
                    yield from self._offset(waiting, name.removesuffix(".scales"), "scales", array)
            elif name.endswith(".g_idx"):
                self._check_g_idx(name, np.asarray(array))
            elif name.endswith(".qzeros"):
                if self.zero_shift is not None:
                    zeros = int4.unpack_unsigned(array, axis=1).astype(np.int32) + self.zero_shift
                    yield from self._offset(waiting, name.removesuffix(".qzeros"), "zeros", zeros)
            else:
                yield name, array
        for layer, have in waiting.items():
            lacking = "qzeros" if "scales" in have else "scales"
            raise ValueError(f"the GPTQ checkpoint (sym false) lacks {layer}.{lacking}")

    def _hf_layout(self, value: np.ndarray) -> np.ndarray:
        """A `[in / G, out]` per-group tensor as `[out, in / G]` float32, `[out]` per channel."""
        value = np.asarray(value, np.float32).T
        return value[:, 0] if self.group_size is None else value

    def _offset(
        self, waiting: dict[str, dict[str, np.ndarray]], layer: str, kind: str, value: np.ndarray
    ) -> Iterator[tuple[str, np.ndarray]]:
        """The layer's `weight_offset` once both its scales and zero points have come."""
        parts = waiting.setdefault(layer, {})
        parts[kind] = value
        if len(parts) == 2:
            del waiting[layer]
            scale, zeros = parts["scales"], parts["zeros"]
            if zeros.shape[0] != scale.shape[0] or zeros.shape[1] < scale.shape[1]:
                raise ValueError(
                    f"GPTQ tensor {layer}.qzeros holds zero points {zeros.shape}, its scales "
                    f"{tuple(scale.shape)}: not one per group and output"
                )
            offset = int4.affine_from_zero_points(scale, zeros[:, : scale.shape[1]])
            yield layer + ".weight_offset", self._hf_layout(offset)

    def _check_g_idx(self, name: str, g_idx: np.ndarray) -> None:
        inputs = np.arange(g_idx.shape[0])
        if not np.array_equal(g_idx, inputs // (self.group_size or g_idx.shape[0])):
            raise ValueError(
                f"checkpoint tensor {name!r} reorders the inputs of its groups (activation "
                "reordering); vllm-xla loads GPTQ weights whose groups are consecutive inputs only"
            )


def gptq_layout(
    model: nnx.Module,
    path: str,
    names: Callable[[], list[str]],
    our_name: Callable[[str], str | None],
) -> GptqCheckpoint | None:
    """For a GPTQ checkpoint at `path` whose tensor names `names()` lists: gives each layer it
    quantized int4 zeros (held as `int4.held_dtype`) and a scale (in place, before loading) and
    returns how to read it; None for any other checkpoint. `our_name`: an HF name's parameter
    path (the loader's table)."""
    config = quantization_config(path)
    if not config or config.get("quant_method") != METHOD:
        return None
    check_config(config)
    size = group_size(config)
    quantized = {n.removesuffix(".qweight") + ".weight" for n in names() if n.endswith(".qweight")}
    affine = not config.get("sym", True)
    param_map = int8_kernels_for(
        model, quantized, our_name, path, size, int4.held_dtype(), experts_grouped=True, offsets=affine
    )
    shift = (1 if config.get("checkpoint_format", "gptq") == "gptq" else 0) if affine else None
    return GptqCheckpoint(param_map, size, shift)
