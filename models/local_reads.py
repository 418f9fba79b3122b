# SPDX-License-Identifier: Apache-2.0
"""What one host of several reads of a checkpoint: only its own devices' experts (every tensor
of another expert's module left unread) and, of a weight split across the hosts, only the box
its devices hold (a safetensors slice read). `models.loader` applies them; the shardings that
say what is local are the caller's (`tpu_platform.weights.prepared.load_prepared`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from models.expert_stacks import ExpertStacks
from models.param_names import hf_pattern, our_name

# A box of an array: one slice an axis.
Box = tuple[slice, ...]


def read_box(f: Any, name: str, box: Box) -> np.ndarray:
    """The tensor `name` of the open safetensors file `f` with only `box` read (a slice read,
    `get_slice`); zeros elsewhere, whose pages are never written until the array is copied."""
    tensor = f.get_slice(name)
    piece = tensor[box]
    whole = np.zeros(tensor.get_shape(), piece.dtype)
    whole[box] = piece
    return whole


def expert_reads(
    only: Callable[[str], bool] | None,
    rule: Callable[[str], str | None],
    hf_param_map: dict[str, str],
    stacks: ExpertStacks,
) -> Callable[[str], bool] | None:
    """The checkpoint tensors to read: those `only` accepts, less every tensor of an expert's
    module (`...experts.{e}.down_proj.`: its weight and whatever a quantized format keeps beside
    it, scales, zero points, packed values) that no device of this process holds (`stacks.holds`).
    `rule`: the name the model reads a checkpoint tensor under (`loader.model_name_rule`)."""
    if stacks.local is None:
        return only
    modules = _expert_modules(hf_param_map)

    def read(hf: str) -> bool:
        if only is not None and not only(hf):
            return False
        renamed = rule(hf)
        for pattern, ours in modules if renamed is not None else ():
            match = pattern.match(renamed)
            if match:
                ours = ours.replace("{i}", match["i"]) if "i" in match.groupdict() else ours
                return stacks.holds(ours, int(match["e"]))
        return True

    return read


def part_reader(
    rule: Callable[[str], str | None],
    compiled: list[tuple[re.Pattern[str], str]],
    expected: dict[str, Any],
    parts: Callable[[str], Box | None] | None,
) -> Callable[[str], Box | None] | None:
    """The box of each checkpoint tensor to read (`iter_checkpoint`'s `part`) from `parts` (by
    our parameter path, `expected`: their unprepared values): a tensor that is one whole
    parameter as it is (a kernel transposed); None (read whole) for any other."""
    if parts is None:
        return None

    def part(hf: str) -> Box | None:
        renamed = rule(hf)
        found = None if renamed is None else our_name(renamed, compiled)
        if found is None or found[1] is not None or found[0] not in expected:
            return None
        ours = found[0]
        box = parts(ours)
        # a kernel is read transposed (`.T`: every axis reversed), so its box is too
        return None if box is None else (box[::-1] if ours.endswith("kernel") else box)

    return part


def _expert_modules(hf_param_map: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    """The module prefix of each per-expert HF name (`...experts.{e}.down_proj.weight` ->
    `...experts.{e}.down_proj.`), matching any tensor of that module, with our stack's path."""
    modules = {hf.rsplit(".", 1)[0] + ".": ours for hf, ours in hf_param_map.items() if "{e}" in hf}
    return [(re.compile(hf_pattern(module)), ours) for module, ours in modules.items()]
