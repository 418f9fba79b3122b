# SPDX-License-Identifier: Apache-2.0
"""A model's prepared host weights on disk (vLLM's `load_format="npcache"`).

Loading a checkpoint parses it, casts every tensor to the model's dtype, fuses projections and
packs kernels for the native CPU dense kernel: most of a warm `generate`'s own start-up for the
embedded model. The weights cache keeps the result (the model's structure and
its final host arrays, one file, arrays 64-byte aligned), so a later start maps one file and
hands views of it to the device, several times faster.

An entry is named by the model directory and the variant (dtype, packing), and keyed by what
decides its bytes: the checkpoint files' names, sizes and modification times, the model's
`config.json`, JAX's and Flax's versions and our code's fingerprint. Storing an entry removes
the entries of the same model and variant under other keys, so the cache keeps one per variant,
and the entries no start has used for 30 days (`programs.remove_unused`).
A missing, stale or unreadable entry is a miss: the checkpoint is loaded (and stored) as usual;
so is an entry another user could have written (`private_files`: its header is unpickled).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import mmap
import os
import pickle
import struct
from pathlib import Path

import flax
import jax
import numpy as np
from flax import nnx

from models.loader import checkpoint_files
from tpu_platform.private_files import UnsafeCacheError, check_private, make_private_dir, open_private
from tpu_platform.programs import mark_used, remove_unused, source_fingerprint

logger = logging.getLogger(f"vllm_xla.{__name__}")

_MAGIC = b"VXLAWTS1"
_PREAMBLE = struct.Struct("<8sQ")  # magic, header bytes
_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class WeightsCache:
    """Where one model's prepared weights for one variant live, under the current key."""

    path: str
    # Entries of the same model and variant start so, whatever their key.
    variant_prefix: str

    @classmethod
    def for_model(
        cls, directory: str, model_path: str, variant: str, memo_dir: str | None = None
    ) -> WeightsCache:
        """The entry for `model_path` (a model directory) as `variant` (e.g.
        "bfloat16-avx512_bf16") prepares it; `memo_dir`: see `programs.source_fingerprint`."""
        model_id = hashlib.sha256(os.path.realpath(model_path).encode()).hexdigest()[:16]
        prefix = os.path.join(directory, f"{model_id}-{variant}-")
        return cls(path=f"{prefix}{_key(model_path, variant, memo_dir)[:32]}.npcache", variant_prefix=prefix)

    def load(self) -> nnx.Module | None:
        """The model with the stored host weights, or None when this key has no readable entry."""
        try:
            check_private(self.path)  # the header is unpickled
            model = _read_model(self.path)
            mark_used(self.path)
            return model
        except FileNotFoundError:
            return None
        except UnsafeCacheError as error:
            logger.warning("%s; loading the checkpoint instead", error)
            return None
        except Exception as error:  # a truncated or foreign entry: load the checkpoint instead
            logger.warning("dropping unreadable weights cache entry %s (%s)", self.path, error)
            Path(self.path).unlink(missing_ok=True)
            return None

    def store(self, model: nnx.Module) -> None:
        """Keeps `model`'s host weights under this key; drops the variant's other entries."""
        try:
            make_private_dir(os.path.dirname(self.path))
            _write_entry(self.path, model)
        except (OSError, ValueError, TypeError, pickle.PicklingError) as error:
            logger.warning("could not cache the prepared weights at %s (%s)", self.path, error)
            return
        for entry in Path(self.path).parent.glob(f"{os.path.basename(self.variant_prefix)}*.npcache"):
            if str(entry) != self.path:
                entry.unlink(missing_ok=True)
        remove_unused(os.path.dirname(self.path), ".npcache")  # other models' entries unused for 30 days


def _key(model_path: str, variant: str, memo_dir: str | None) -> str:
    files = checkpoint_files(model_path)
    config = os.path.join(model_path, "config.json")
    if os.path.isfile(config):
        files = [*files, config]
    identity = [(os.path.basename(f), *_size_and_mtime(f)) for f in files]
    parts = (identity, variant, jax.__version__, flax.__version__, source_fingerprint(memo_dir=memo_dir))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _size_and_mtime(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def _write_entry(path: str, model: nnx.Module) -> None:
    """Preamble, pickled header (structure, tree, array table), then the arrays, each aligned;
    streamed to a temporary file that then replaces `path` (readers never see part of it)."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    table, offset = [], 0
    for leaf in leaves:
        if not isinstance(leaf, np.ndarray):
            raise TypeError(f"a host weight is a {type(leaf).__name__}, not a NumPy array")
        offset += -offset % _ALIGN
        table.append((offset, leaf.dtype.name, leaf.shape))
        offset += leaf.nbytes
    header = pickle.dumps((graphdef, treedef, table, offset))
    partial = f"{path}.{os.getpid()}.tmp"
    try:
        with open_private(partial) as f:
            f.write(_PREAMBLE.pack(_MAGIC, len(header)) + header)
            f.write(bytes(_data_start(len(header)) - f.tell()))
            start = f.tell()
            for (at, _, _), leaf in zip(table, leaves, strict=True):
                f.write(bytes(start + at - f.tell()))
                f.write(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8).data)
        os.replace(partial, path)
    finally:
        Path(partial).unlink(missing_ok=True)


def _read_model(path: str) -> nnx.Module:
    """Maps the entry (copy on write, all pages at once: steadier than reading it into fresh
    memory, whose time varied widely) and rebuilds the model around views of it; the device takes
    aligned host arrays in place on the CPU, so they are the weights the programs read."""
    with open(path, "rb") as f:
        magic, header_bytes = _PREAMBLE.unpack(f.read(_PREAMBLE.size))
        if magic != _MAGIC:
            raise ValueError("not a vllm-xla weights cache entry")
        graphdef, treedef, table, data_bytes = pickle.loads(f.read(header_bytes))
        start = _data_start(header_bytes)
        if os.fstat(f.fileno()).st_size != start + data_bytes:
            raise ValueError("truncated")
        mapped = mmap.mmap(
            f.fileno(),
            start + data_bytes,
            flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
    data = np.frombuffer(mapped, np.uint8, count=data_bytes, offset=start)
    leaves = [
        data[at : at + int(np.prod(shape, dtype=np.int64)) * _dtype(name).itemsize]
        .view(_dtype(name))
        .reshape(shape)
        for at, name, shape in table
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _data_start(header_bytes: int) -> int:
    end = _PREAMBLE.size + header_bytes
    return end + -end % _ALIGN


def _dtype(name: str) -> np.dtype:
    return np.dtype(jax.numpy.dtype(name))  # bfloat16 and the float8s are ml_dtypes' names
