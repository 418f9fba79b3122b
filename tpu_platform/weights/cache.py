# SPDX-License-Identifier: Apache-2.0
"""A model's prepared weights kept on disk (vLLM's `load_format="npcache"`), as Orbax checkpoints.

Loading a checkpoint parses it, casts every tensor to the model's dtype, fuses projections and
packs kernels for the native CPU dense kernel, most of a warm `generate`'s own start-up for the
embedded model. The weights cache keeps the result as an Orbax checkpoint of the prepared state
(`prepared`: arrays and a small JSON metadata, no pickle), and a later start restores it
straight onto the target shardings.

An entry is named by the model directory and the preparation (dtype, packing), and keyed by what
decides its bytes: the checkpoint files' names, sizes and modification times, the model's
`config.json`, JAX's and Flax's versions and our code's fingerprint. Storing an entry removes
the entries of the same model and preparation under other keys, so the cache keeps one per
preparation, and the entries no start has used for 30 days. A missing, stale, damaged or foreign
entry is a miss (logged when it was there): the checkpoint is loaded (and stored) as usual. An
entry, or the cache directory, or a directory above it, that another user owns or may write is
never read (`private_files`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import flax
import jax
from flax import nnx

from models import ModelConfig
from models.checkpoint_reads import checkpoint_files
from models.linear import Linear, float_layers
from models.moe import StackedLinear
from tpu_platform.disk_cache import UNUSED_ENTRY_SECONDS, mark_used, remove_unused, source_fingerprint
from tpu_platform.private_files import make_private_dir, make_tree_private, unsafe_tree_reason
from tpu_platform.weights.preparation import Preparation
from tpu_platform.weights.prepared import (
    ShardingFor,
    UnusableCheckpoint,
    metadata_for,
    restore_prepared,
    save_prepared,
)

logger = logging.getLogger(f"vllm_xla.{__name__}")

_SUFFIX = ".orbax"
_STAGING = ".staging-"  # a store in progress: `<entry>.staging-<pid>-<random>`


@dataclasses.dataclass(frozen=True)
class WeightsCache:
    """Where one model's prepared weights for one preparation live, under the current key."""

    path: str
    key: str
    preparation: Preparation
    # Entries of the same model and preparation start so, whatever their key.
    variant_prefix: str

    @classmethod
    def for_model(
        cls, directory: str, model_path: str, preparation: Preparation, memo_dir: str | None = None
    ) -> WeightsCache:
        """The entry for `model_path` (a model directory) as `preparation` prepares it;
        `memo_dir`: see `programs.source_fingerprint`."""
        model_id = hashlib.sha256(os.path.realpath(model_path).encode()).hexdigest()[:16]
        prefix = os.path.join(directory, f"{model_id}-{preparation.name}-")
        key = _key(model_path, preparation, memo_dir)[:32]
        return cls(path=f"{prefix}{key}{_SUFFIX}", key=key, preparation=preparation, variant_prefix=prefix)

    def load(self, model_config: ModelConfig, shardings: ShardingFor) -> nnx.Module | None:
        """The prepared model with its weights restored onto `shardings`, or None when this key
        has no usable entry (a damaged or foreign one is logged and removed)."""
        if not os.path.isdir(self.path):
            return None
        unsafe = unsafe_tree_reason(self.path)
        if unsafe:
            logger.warning("not reading the weights cache entry %s: %s", self.path, unsafe)
            return None
        try:
            model = restore_prepared(self.path, model_config, self.preparation, shardings, {"key": self.key})
        except UnusableCheckpoint as error:
            logger.warning("dropping unusable weights cache entry %s (%s)", self.path, error)
            shutil.rmtree(self.path, ignore_errors=True)
            return None
        mark_used(self.path)
        return model

    def store(self, model_config: ModelConfig, model: nnx.Module) -> None:
        """Keeps `model`'s prepared weights under this key; drops the preparation's other entries.
        A model whose layers reorder their inputs (a GPTQ act-order checkpoint's `input_order`) is
        not kept: its structure comes from the checkpoint's g_idx, not from the config that a
        restore rebuilds it from."""
        if reorders_inputs(model):
            return
        directory = os.path.dirname(self.path)
        try:
            make_private_dir(directory)
            unsafe = unsafe_tree_reason(directory)
            if unsafe:  # never read from there: not worth writing
                logger.warning("not caching the prepared weights in %s: %s", directory, unsafe)
                return
            state = nnx.state(model)
            # Orbax's own temporary name is the destination's plus a fixed suffix: two processes
            # storing one entry at once would write into the same directory. Each writes its own
            # staging copy instead, and the first rename wins.
            staging = f"{self.path}{_STAGING}{os.getpid()}-{os.urandom(4).hex()}"
            metadata = metadata_for(model_config, self.preparation, state, float_layers(model), key=self.key)
            save_prepared(staging, state, metadata)
            make_tree_private(staging)
            if not _rename_unless_present(staging, self.path):
                shutil.rmtree(staging, ignore_errors=True)  # another process stored it first
        except Exception as error:  # a full disk: serve anyway
            logger.warning("could not cache the prepared weights at %s (%s)", self.path, error)
            return
        for entry in Path(directory).glob(f"{os.path.basename(self.variant_prefix)}*{_SUFFIX}"):
            if str(entry) != self.path:
                shutil.rmtree(entry, ignore_errors=True)
        _remove_unused_entries(directory)
        remove_unused(directory, ".npcache", unused_seconds=0)  # the former single-file format


def reorders_inputs(model: nnx.Module) -> bool:
    """Whether a layer of `model` gathers its inputs into another order (`Linear.input_order`, an
    expert stack's `StackedLinear.input_order`)."""
    layers = (m for _, m in nnx.iter_modules(model) if isinstance(m, (Linear, StackedLinear)))
    return any(m.input_order is not None for m in layers)


def _key(model_path: str, preparation: Preparation, memo_dir: str | None) -> str:
    files = checkpoint_files(model_path)
    config = os.path.join(model_path, "config.json")
    if os.path.isfile(config):
        files = [*files, config]
    identity = [(os.path.basename(f), *_size_and_mtime(f)) for f in files]
    parts = (
        identity, preparation.name, jax.__version__, flax.__version__, source_fingerprint(memo_dir=memo_dir)
    )  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _size_and_mtime(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def _rename_unless_present(source: str, destination: str) -> bool:
    """Renames directory `source` to `destination`; False when `destination` already exists
    (a rename onto a non-empty directory fails, so a concurrent winner is never replaced)."""
    try:
        os.rename(source, destination)
    except OSError:
        if os.path.isdir(destination):
            return False
        raise
    return True


def _remove_unused_entries(directory: str) -> None:
    """Removes the entries (of any model) no start has used for 30 days (loading touches one),
    and the remains of stores that died."""
    now = time.time()
    # Orbax writes an entry under a temporary name first: one a day old is a store that died.
    stale = [
        (f"*{_SUFFIX}", now - UNUSED_ENTRY_SECONDS),
        (f"*{_SUFFIX}.orbax-checkpoint-tmp*", now - 24 * 3600),
        (f"*{_SUFFIX}{_STAGING}*", now - 24 * 3600),
    ]
    for pattern, cutoff in stale:
        for entry in Path(directory).glob(pattern):
            try:
                if entry.stat().st_mtime < cutoff:
                    shutil.rmtree(entry)
            except OSError:  # gone already, or not ours to remove
                continue
