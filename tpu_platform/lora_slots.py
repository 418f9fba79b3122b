# SPDX-License-Identifier: Apache-2.0
"""The runner's LoRA adapters: a host cache of read adapters and the model's device slots.

Semantics follow vLLM's LRU worker manager: up to `max_cpu_loras` adapters stay read on the
host (least recently used evicted first), up to `max_loras` sit in device slots at once (the
scheduler never puts more different adapters in one step); a step whose adapters are not all in
slots takes the least recently used slots the step does not need. An adapter named by a request
is read from its path when it is not cached (again after an eviction).

What keeps one adapter or request from stopping the others:
- an adapter is read and checked whole before anything changes: a failed read leaves the cache
  and the slots as they were (and, across hosts, every host refuses it when one does, so that no
  host ends up with other weights: `agree`);
- an adapter that a live request uses stays cached until its last request ends (it is never read
  again mid-request), as does one pinned by vLLM's `pin_lora`; when every cached adapter is kept
  so, the cache holds more than `max_cpu_loras` for a while rather than fail a request;
- a step reads every missing adapter first and only then takes slots, never one of its own;
- removing an adapter that requests still use takes effect when the last of them ends.

A slot is written on the host copy of each site's slot arrays, and each changed array is put on
the device whole as a new array that replaces its state leaf: the step's shapes never change
(no compile), and a step still running keeps the arrays it was given.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
from collections.abc import Callable

import jax
import numpy as np
from jax.tree_util import DictKey

from models.lora import LoraSite
from models.lora_files import LoraAdapter, read_adapter
from tpu_platform.hosts import agree_across_hosts

logger = logging.getLogger(f"vllm_xla.{__name__}")

# Every host's outcome of one read, gathered: this host's `(error or None, digest)` in, every
# host's out in host order (`hosts.agree_across_hosts`). One host: itself.
Agreement = Callable[[str | None, bytes], list[tuple[str | None, bytes]]]


def _alone(error: str | None, digest: bytes) -> list[tuple[str | None, bytes]]:
    return [(error, digest)]


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


class LoraUnavailable(ValueError):
    """A step's adapter could not be read (it names the adapter and why); `lora_ids` are the
    adapters concerned. The cache and slots are as they were before the step."""

    def __init__(self, message: str, lora_ids: tuple[int, ...]):
        super().__init__(message)
        self.lora_ids = lora_ids


class LoraSlots:
    """Adapters by vLLM's integer id, and which device slot (1..max_loras) each active one holds."""

    def __init__(
        self,
        config: LoraConfig,
        sites: dict[str, LoraSite],
        state: object,
        leaves: list[jax.Array],
        agree: Agreement | None = None,
    ):
        self.config = config
        self.sites = sites
        # across hosts every host's worker reads each adapter at the same point (vLLM sends its
        # LoRA calls and steps to all of them): they agree before any writes a slot
        self._agree = agree or (agree_across_hosts if jax.process_count() > 1 else _alone)
        self._leaves = leaves  # the runner's state leaves: slot arrays are replaced in this list
        self._index = _slot_leaf_indices(state, sites)
        self._host = {i: np.array(leaves[i]) for pair in self._index.values() for i in pair}
        self._slot_dtype = next(iter(self._host.values())).dtype if self._host else np.dtype(np.float32)
        self._paths: dict[int, tuple[str, str]] = {}  # id -> (name, path): to read it again
        self._cache: collections.OrderedDict[int, LoraAdapter] = collections.OrderedDict()
        self._pinned: set[int] = set()
        self._users: collections.Counter[int] = collections.Counter()  # live requests per id
        self._removed: set[int] = set()  # removed while in use: forgotten when its last user ends
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU first
        # vLLM's ids are any positive int (a resolver may hash a name): rows hold small handles.
        self._handles: dict[int, int] = {}
        self._id_of_handle = np.zeros(1, np.int64)

    # -- vLLM's add_lora / remove_lora / pin_lora / list_loras ----------------------------------

    def add(self, lora_id: int, name: str, path: str, *, replace: bool = False) -> bool:
        """Reads adapter `lora_id` into the host cache (a ValueError names what is wrong with it,
        and nothing changes); False when it was there already from the same path (and `replace`,
        vLLM's `load_inplace`, is not asked). Another path for a known id needs `replace`."""
        known = self._paths.get(lora_id)
        if lora_id in self._cache and not replace:
            if known is not None and known[1] != path:
                raise ValueError(
                    f"LoRA adapter {name!r} (id {lora_id}) is loaded from {known[1]!r}; to load "
                    f"{path!r} in its place pass load_inplace=True, or give it another id"
                )
            self._cache.move_to_end(lora_id)
            return False
        adapter = self._read(lora_id, name, path)
        self._paths[lora_id] = (name, path)
        self._removed.discard(lora_id)
        self._admit(lora_id, adapter, keep=set(), strict=True)
        return True

    def remove(self, lora_id: int) -> bool:
        """Forgets adapter `lora_id` (its slot is zeroed); False when it was not there. One that
        live requests use is forgotten when the last of them ends."""
        known = lora_id in self._cache or lora_id in self._slot_of or lora_id in self._paths
        if self._users[lora_id] > 0:
            self._removed.add(lora_id)
            self._pinned.discard(lora_id)
            return known
        self._forget(lora_id)
        return known

    def pin(self, lora_id: int) -> bool:
        """Keeps adapter `lora_id` cached and, once in a slot, in its slot."""
        if lora_id not in self._cache or lora_id in self._removed:
            raise ValueError(f"LoRA adapter id {lora_id} is not loaded; add it before pinning it")
        self._pinned.add(lora_id)
        return True

    def ids(self) -> set[int]:
        return set(self._cache) - self._removed

    def remember(self, lora_id: int, name: str, path: str) -> None:
        """Where to read adapter `lora_id` when a step needs it (a request named it). The path
        it was first added or named with stays its path (vLLM's id names one adapter)."""
        known = self._paths.setdefault(lora_id, (name, path))
        self._removed.discard(lora_id)  # named again by a request: vLLM's request re-adds it
        if known[1] != path:
            logger.warning(
                "a request names LoRA adapter id %d with path %s, but it was loaded from %s: the "
                "loaded adapter serves it (load it with load_inplace=True to change its weights)",
                lora_id, path, known[1],
            )  # fmt: skip

    # -- a request's lifetime -------------------------------------------------------------------

    def handle(self, lora_id: int) -> int:
        """A small int32 standing for adapter `lora_id` in the request table (never 0)."""
        if lora_id not in self._handles:
            self._handles[lora_id] = len(self._id_of_handle)
            self._id_of_handle = np.append(self._id_of_handle, lora_id)
        return self._handles[lora_id]

    def acquire(self, handle: int) -> None:
        """A live request uses adapter `handle` (0: none): it stays cached until `release`."""
        if handle > 0:
            self._users[int(self._id_of_handle[handle])] += 1

    def release(self, handle: int) -> None:
        """A request that used adapter `handle` (0: none) has ended."""
        if handle <= 0:
            return
        lora_id = int(self._id_of_handle[handle])
        self._users[lora_id] -= 1
        if self._users[lora_id] <= 0:
            del self._users[lora_id]
            if lora_id in self._removed:
                self._forget(lora_id)

    # -- per step -------------------------------------------------------------------------------

    def slots_for(self, handles: np.ndarray) -> np.ndarray:
        """The device slot of each of a step's rows' adapters (`handle`s; 0: none), putting the
        step's adapters in slots first. A LoraUnavailable names an adapter that could not be read
        (then nothing has changed)."""
        wanted = [int(self._id_of_handle[h]) for h in np.unique(handles) if h > 0]
        if len(wanted) > self.config.max_loras:
            raise ValueError(f"a step uses {len(wanted)} LoRA adapters but max_loras={self.config.max_loras}")
        if not wanted:
            return np.zeros(handles.shape, np.int32)
        for lora_id, adapter in self._read_missing(wanted).items():
            self._admit(lora_id, adapter, keep=set(wanted), strict=False)
        for lora_id in wanted:
            self._activate(lora_id, wanted)
        table = np.zeros(len(self._id_of_handle), np.int32)
        for lora_id in wanted:
            table[self._handles[lora_id]] = self._slot_of[lora_id]
        return table[handles]

    def read_ahead(self, lora_ids: list[int]) -> dict[int, str]:
        """Reads each adapter of `lora_ids` (a step's new requests') that is not cached, keeping
        them and those in use cached; returns why each one that could not be read was not."""
        failed = {}
        for lora_id in dict.fromkeys(lora_ids):
            try:
                for i, adapter in self._read_missing([lora_id]).items():
                    self._admit(i, adapter, keep=set(lora_ids), strict=False)
            except LoraUnavailable as error:
                failed[lora_id] = str(error)
        return failed

    def _read_missing(self, wanted: list[int]) -> dict[int, LoraAdapter]:
        """Every adapter of `wanted` that is not cached, read; none when any cannot be."""
        read, failed = {}, {}
        for lora_id in wanted:
            if lora_id in self._cache:
                self._cache.move_to_end(lora_id)
                continue
            if lora_id not in self._paths:
                failed[lora_id] = f"LoRA adapter id {lora_id} was never added and no request named its path"
                continue
            try:
                read[lora_id] = self._read(lora_id, *self._paths[lora_id])
            except ValueError as error:
                failed[lora_id] = str(error)
        if failed:
            raise LoraUnavailable("; ".join(failed.values()), tuple(failed))
        return read

    def _read(self, lora_id: int, name: str, path: str) -> LoraAdapter:
        """Reads and checks the adapter; across hosts, refused on every host when any host
        refuses it or read other values."""
        error, adapter, digest = None, None, b""
        try:
            adapter = read_adapter(name, path, self.sites, self.config.max_lora_rank, self._slot_dtype)
            digest = _digest(adapter)
        except ValueError as refused:
            error = str(refused)
        outcomes = self._agree(error, digest)
        if len(outcomes) > 1:
            error = _disagreement(name, outcomes) or error
        if error is not None:
            raise ValueError(error)
        logger.info("LoRA adapter %r (id %d, rank %d) read from %s", name, lora_id, adapter.rank, path)
        return adapter

    def _admit(self, lora_id: int, adapter: LoraAdapter, *, keep: set[int], strict: bool) -> None:
        """Caches `adapter`, evicting the least recently used adapters not kept (pinned, in use,
        in `keep`) while the cache is full. `strict`: refuse when vLLM's pins fill the cache."""
        while len(self._cache) >= self.config.cpu_capacity and lora_id not in self._cache:
            victim = next((i for i in self._cache if not self._kept(i, keep)), None)
            if victim is None:
                if strict and len(self._pinned & set(self._cache)) >= self.config.cpu_capacity:
                    raise ValueError(
                        f"LoRA adapter {adapter.name!r}: all {self.config.cpu_capacity} cached adapters "
                        "are pinned; raise max_cpu_loras or unpin one"
                    )
                logger.debug("LoRA host cache above max_cpu_loras: every cached adapter is in use")
                break
            self._evict(victim)
        self._cache[lora_id] = adapter
        self._cache.move_to_end(lora_id)
        if lora_id in self._slot_of:  # replaced in place: its slot gets the new weights
            self._write_slot(self._slot_of[lora_id], adapter)

    def _kept(self, lora_id: int, keep: set[int]) -> bool:
        return lora_id in keep or lora_id in self._pinned or self._users[lora_id] > 0

    def _activate(self, lora_id: int, step_ids: list[int]) -> None:
        if lora_id in self._slot_of:
            self._slot_of.move_to_end(lora_id)
            return
        used = set(self._slot_of.values())
        free = [s for s in range(1, self.config.max_loras + 1) if s not in used]
        if free:
            slot = free[0]
        else:  # the least recently used slot this step does not need, unpinned ones first
            candidates = [i for i in self._slot_of if i not in step_ids]
            victim = next((i for i in candidates if i not in self._pinned), candidates[0])
            slot = self._slot_of.pop(victim)
        self._slot_of[lora_id] = slot
        self._write_slot(slot, self._cache[lora_id])

    def _evict(self, lora_id: int) -> None:
        self._cache.pop(lora_id)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._write_slot(slot, None)

    def _forget(self, lora_id: int) -> None:
        self._removed.discard(lora_id)
        self._pinned.discard(lora_id)
        self._paths.pop(lora_id, None)
        if lora_id in self._cache:
            self._evict(lora_id)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._write_slot(slot, None)

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


def _digest(adapter: LoraAdapter) -> bytes:
    """A fingerprint of the values an adapter would put in slots (hosts compare them)."""
    h = hashlib.sha256(f"{adapter.rank}:{adapter.scaling!r}".encode())
    for key in sorted(adapter.slot_values):
        h.update(key.encode())
        for value in adapter.slot_values[key]:
            h.update(np.ascontiguousarray(value).tobytes())
    return h.digest()


def _disagreement(name: str, outcomes: list[tuple[str | None, bytes]]) -> str | None:
    """Why every host refuses an adapter some host refused or read differently; None: agreed."""
    errors = [f"host {h}: {e}" for h, (e, _) in enumerate(outcomes) if e is not None]
    if errors:
        return f"LoRA adapter {name!r} is refused on every host: " + "; ".join(errors)
    digests = {d for _, d in outcomes}
    if len(digests) > 1:
        groups = collections.defaultdict(list)
        for h, (_, d) in enumerate(outcomes):
            groups[d].append(h)
        return (
            f"LoRA adapter {name!r} is refused on every host: the hosts read different files "
            f"(hosts {' vs '.join(str(g) for g in groups.values())}); give every host the same adapter"
        )
    return None


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
