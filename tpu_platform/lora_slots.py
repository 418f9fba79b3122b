# SPDX-License-Identifier: Apache-2.0
"""The runner's LoRA adapters: a host cache of read adapters and the model's device slots.

Semantics follow vLLM's LRU worker manager: up to `max_cpu_loras` adapters stay read on the
host (least recently used evicted first, pinned ones never), up to `max_loras` sit in device
slots at once (the scheduler never puts more different adapters in one step); a step whose
adapters are not all in slots takes the least recently used slots not needed by the step. An
adapter named by a request is read from its path when it is not cached (again after an eviction).

A slot is written on the host copy of each site's slot arrays, and each changed array is put on
the device whole as a new array that replaces its state leaf: the step's shapes never change
(no compile), and a step still running keeps the arrays it was given.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import jax
import numpy as np
from jax.tree_util import DictKey

from models.lora import LoraSite
from models.lora_files import LoraAdapter, read_adapter

logger = logging.getLogger(f"vllm_xla.{__name__}")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """vLLM's `max_loras`, `max_lora_rank`, `max_cpu_loras` (at least `max_loras`) and
    `lora_dtype` (None: the model's dtype)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    dtype: str | None = None

    @property
    def cpu_capacity(self) -> int:
        return max(self.max_cpu_loras or self.max_loras, self.max_loras)


class LoraSlots:
    """Adapters by vLLM's integer id, and which device slot (1..max_loras) each active one holds."""

    def __init__(
        self,
        config: LoraConfig,
        sites: dict[str, LoraSite],
        state: object,
        leaves: list[jax.Array],
    ):
        self.config = config
        self.sites = sites
        self._leaves = leaves  # the runner's state leaves: slot arrays are replaced in this list
        self._index = _slot_leaf_indices(state, sites)
        self._host = {i: np.array(leaves[i]) for pair in self._index.values() for i in pair}
        self._paths: dict[int, tuple[str, str]] = {}  # id -> (name, path): to read it again
        self._cache: collections.OrderedDict[int, LoraAdapter] = collections.OrderedDict()
        self._pinned: set[int] = set()
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU first
        # vLLM's ids are any positive int (a resolver may hash a name): rows hold small handles.
        self._handles: dict[int, int] = {}
        self._id_of_handle = np.zeros(1, np.int64)

    # -- vLLM's add_lora / remove_lora / pin_lora / list_loras ----------------------------------

    def add(self, lora_id: int, name: str, path: str, *, replace: bool = False) -> bool:
        """Reads adapter `lora_id` into the host cache (a ValueError names what is wrong with it);
        False when it was there already (and `replace` is not asked)."""
        if lora_id in self._cache and not replace:
            self._cache.move_to_end(lora_id)
            return False
        adapter = read_adapter(name, path, self.sites, self.config.max_lora_rank)
        self._paths[lora_id] = (name, path)
        while len(self._cache) >= self.config.cpu_capacity and lora_id not in self._cache:
            if not self._evict_cached():
                raise ValueError(
                    f"LoRA adapter {name!r}: all {self.config.cpu_capacity} cached adapters are pinned; "
                    "raise max_cpu_loras or unpin one"
                )
        self._cache[lora_id] = adapter
        self._cache.move_to_end(lora_id)
        if lora_id in self._slot_of:  # replaced in place: its slot gets the new weights
            self._write_slot(self._slot_of[lora_id], adapter)
        logger.info("LoRA adapter %r (id %d, rank %d) read from %s", name, lora_id, adapter.rank, path)
        return True

    def remove(self, lora_id: int) -> bool:
        """Forgets adapter `lora_id` (its slot is zeroed); False when it was not there."""
        known = self._cache.pop(lora_id, None) is not None
        self._pinned.discard(lora_id)
        self._paths.pop(lora_id, None)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._write_slot(slot, None)
        return known or slot is not None

    def pin(self, lora_id: int) -> bool:
        """Keeps adapter `lora_id` cached and, once in a slot, in its slot."""
        if lora_id not in self._cache:
            raise ValueError(f"LoRA adapter id {lora_id} is not loaded; add it before pinning it")
        self._pinned.add(lora_id)
        return True

    def ids(self) -> set[int]:
        return set(self._cache)

    def remember(self, lora_id: int, name: str, path: str) -> None:
        """Where to read adapter `lora_id` when a step needs it (a request named it)."""
        self._paths.setdefault(lora_id, (name, path))

    # -- per step -------------------------------------------------------------------------------

    def handle(self, lora_id: int) -> int:
        """A small int32 standing for adapter `lora_id` in the request table (never 0)."""
        if lora_id not in self._handles:
            self._handles[lora_id] = len(self._id_of_handle)
            self._id_of_handle = np.append(self._id_of_handle, lora_id)
        return self._handles[lora_id]

    def slots_for(self, handles: np.ndarray) -> np.ndarray:
        """The device slot of each of a step's rows' adapters (`handle`s; 0: none), putting the
        step's adapters in slots first."""
        wanted = [int(self._id_of_handle[h]) for h in np.unique(handles) if h > 0]
        if len(wanted) > self.config.max_loras:
            raise ValueError(f"a step uses {len(wanted)} LoRA adapters but max_loras={self.config.max_loras}")
        for lora_id in wanted:
            self._activate(lora_id, wanted)
        if not wanted:
            return np.zeros(handles.shape, np.int32)
        table = np.zeros(len(self._id_of_handle), np.int32)
        for lora_id in wanted:
            table[self._handles[lora_id]] = self._slot_of[lora_id]
        return table[handles]

    def _activate(self, lora_id: int, step_ids: list[int]) -> None:
        if lora_id in self._slot_of:
            self._slot_of.move_to_end(lora_id)
            return
        adapter = self._cache.get(lora_id)
        if adapter is None:
            if lora_id not in self._paths:
                raise ValueError(f"LoRA adapter id {lora_id} was never added and no request named its path")
            self.add(lora_id, *self._paths[lora_id])
            adapter = self._cache[lora_id]
        used = set(self._slot_of.values())
        free = [s for s in range(1, self.config.max_loras + 1) if s not in used]
        if free:
            slot = free[0]
        else:  # the least recently used slot this step does not need, unpinned ones first
            candidates = [i for i in self._slot_of if i not in step_ids]
            victim = next((i for i in candidates if i not in self._pinned), candidates[0])
            slot = self._slot_of.pop(victim)
        self._slot_of[lora_id] = slot
        self._write_slot(slot, adapter)

    def _evict_cached(self) -> bool:
        for lora_id in self._cache:
            if lora_id not in self._pinned:
                self._cache.pop(lora_id)
                slot = self._slot_of.pop(lora_id, None)
                if slot is not None:
                    self._write_slot(slot, None)
                return True
        return False

    def _write_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Writes `adapter`'s values (zeros for None and for sites it does not target) into `slot`
        of every site, and puts each changed array on the device."""
        for key, (ia, ib) in self._index.items():
            values = None if adapter is None else adapter.slot_values.get(key)
            for i, value in zip((ia, ib), values or (None, None), strict=True):
                host = self._host[i]
                if value is None and not host[slot].any():
                    continue
                host[slot] = 0 if value is None else value.astype(host.dtype)
                # a copy: the device array must not alias the host one written again later
                self._leaves[i] = jax.device_put(host.copy(), self._leaves[i].sharding)


def _slot_leaf_indices(state: object, sites: dict[str, LoraSite]) -> dict[str, tuple[int, int]]:
    """Each site's (a, b) slot arrays' positions among the flat leaves of `state`."""
    found: dict[str, dict[str, int]] = {}
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
        keys = [str(k.key) for k in path if isinstance(k, DictKey)]
        if len(keys) >= 2 and keys[-2] == "lora" and keys[-1] in ("a", "b"):
            found.setdefault(".".join(keys[:-2]), {})[keys[-1]] = i
    missing = sorted(set(sites) - set(found))
    if missing:
        raise ValueError(f"the model state has no LoRA slot arrays for {missing[:3]}")
    return {key: (found[key]["a"], found[key]["b"]) for key in sites}
