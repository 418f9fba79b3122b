# SPDX-License-Identifier: Apache-2.0
"""Expert-stacked `[E, ...]` parameters gathered on the host from a checkpoint's per-expert
tensors (`...experts.{e}...`), one expert at a time, for `models.loader`."""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np


class ExpertStacks:
    """Host buffers of expert-stacked `[E, ...]` parameters, filled one expert tensor at a time;
    each is handed over (and dropped here) as soon as its last expert arrives. `local`: the
    experts of a stack (by our parameter path) that this process's devices hold, None for all:
    the others are never read (`models.loader`), their slots stay zeros and the stack is complete
    without them (a device receives only the slots it holds)."""

    def __init__(self, local: Callable[[str], Collection[int] | None] | None = None) -> None:
        self.buffers: dict[str, np.ndarray] = {}
        self.experts: dict[str, set[int]] = {}
        self.local = local
        self._held: dict[str, Collection[int] | None] = {}  # `local`, asked once a stack

    def held(self, ours: str) -> Collection[int] | None:
        """The experts of the stack `ours` that are read (None: all)."""
        if self.local is None:
            return None
        if ours not in self._held:
            self._held[ours] = self.local(ours)
        return self._held[ours]

    def holds(self, ours: str, expert: int) -> bool:
        """Whether expert `expert` of the stack `ours` is read (a local device holds it)."""
        held = self.held(ours)
        return held is None or expert in held

    def put(
        self, ours: str, expert: int, value: np.ndarray, shape: tuple, dtype, hf: str
    ) -> np.ndarray | None:
        """Fills slot `expert` of `ours` (of `shape`); the whole stack once every held expert is
        in (an expert no local device holds is dropped: a stacked checkpoint's, split on read)."""
        if value.shape != shape[1:] or not 0 <= expert < shape[0]:
            raise ValueError(
                f"checkpoint tensor {hf!r} has shape {value.shape} for expert {expert}, "
                f"expected {shape[1:]} for one of {shape[0]} experts"
            )
        if not self.holds(ours, expert):
            return None
        if ours not in self.buffers:
            self.buffers[ours] = np.zeros(shape, dtype)
            self.experts[ours] = set()
        self.buffers[ours][expert] = value.astype(dtype)
        self.experts[ours].add(expert)
        held = self.held(ours)
        if len(self.experts[ours]) < (shape[0] if held is None else len(held)):
            return None
        del self.experts[ours]
        return self.buffers.pop(ours)

    def held_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers.values())

    def check_complete(self, path: str) -> None:
        for ours, array in self.buffers.items():
            held = self.held(ours)
            absent = sorted(set(range(array.shape[0]) if held is None else held) - self.experts[ours])
            raise ValueError(f"checkpoint {path!r} lacks experts {absent[:8]} of {ours!r}")
