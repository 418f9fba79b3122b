# SPDX-License-Identifier: Apache-2.0
"""4-bit GPTQ checkpoints (`quant_method: "gptq"`), loaded as they are as int4 kernels (`models.int4`).

Such a model directory's `config.json` holds a `quantization_config` like `{"quant_method":
"gptq", "bits": 4, "group_size": 128, "desc_act": false, "sym": true}`, and each quantized
linear layer `<layer>` holds (vLLM's `auto_gptq` layout, `G` the group size, all inputs when
`group_size` is -1):

- `<layer>.qweight`: int32 `[in / 8, out]`, eight 4-bit values of consecutive inputs a word, the
  first in the lowest bits, each stored plus 8 (`uint4b8`): the weight is `(stored - 8) * scale`;
- `<layer>.scales`: float16 `[in / G, out]`, one per group of `G` consecutive inputs and output;
- `<layer>.qzeros`: int32 `[in / G, out / 8]`: a symmetric checkpoint's zero points, 8 (or 7 in
  the original format, which adds one), which vLLM's kernels do not read either: dropped;
- `<layer>.g_idx`: int32 `[in]`, each input's group: `i // G` without activation reordering
  (checked, then dropped).

The stored values minus 8 are int4 as they stand, so a layer loads as int4 values `[in, out]`
with float32 scales `[in / G, out]` (`[out]` per channel), exactly the weights vLLM computes
with. Refused by name: other bit widths (GPTQ's 8-bit and 2/3-bit), `sym: false` (vLLM does not
serve it either), activation reordering (`desc_act: true`, or a `g_idx` that is not `i // G`),
a quantized head (`lm_head: true`) and per-module `dynamic` overrides.
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


def check_config(config: dict) -> None:
    """ValueError naming the field unless `config` is a GPTQ config vllm-xla serves."""
    bits, sym = config.get("bits"), config.get("sym", True)
    if bits != 4:
        raise ValueError(
            f"GPTQ checkpoint with bits={bits!r}: vllm-xla loads 4-bit GPTQ weights only (for 8-bit "
            "weights use an int8 compressed-tensors checkpoint, or --quantization "
            "int8_per_channel_weight_only on the float model)"
        )
    if sym is not True:
        raise ValueError(
            f"GPTQ checkpoint with sym={sym!r}: vllm-xla (like vLLM) loads symmetric GPTQ weights only"
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
    weight) and its group size (None: per channel)."""

    param_map: dict[str, str]
    group_size: int | None

    def tensors(self, tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The checkpoint's tensors as plain int4 `weight` `[out, in]` and float32 `weight_scale`
        (`[out, in / G]`, or `[out]` per channel: HF orientation); `qzeros` dropped, `g_idx`
        checked and dropped."""
        for name, array in tensors:
            if name.endswith(".qweight"):
                yield name.removesuffix(".qweight") + ".weight", int4.unpack_int32(array, axis=0).T
            elif name.endswith(".scales"):
                scale = np.asarray(array, np.float32).T
                yield (
                    name.removesuffix(".scales") + ".weight_scale",
                    scale[:, 0] if self.group_size is None else scale,
                )
            elif name.endswith(".g_idx"):
                self._check_g_idx(name, np.asarray(array))
            elif not name.endswith(".qzeros"):
                yield name, array

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
    param_map = int8_kernels_for(
        model, quantized, our_name, path, size, int4.held_dtype(), experts_grouped=True
    )
    return GptqCheckpoint(param_map, size)
