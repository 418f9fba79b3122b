# SPDX-License-Identifier: Apache-2.0
"""Reading a checkpoint's files: which they are (safetensors, a sharded index, GGUF), their
tensor names and their tensors (safetensors' float8 from its raw bytes; GGUF through
`gguf_reader`). `models.loader` maps what they yield onto a model's parameters."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator

import numpy as np

from models import gguf_reader
from models.fp8 import FP8_DTYPE
from models.local_reads import Box, read_box


def checkpoint_files(path: str) -> list[str]:
    """The weight files of a model directory (or a single file), in load order."""
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    for pattern in ("*.safetensors", "*.gguf"):
        found = sorted(glob.glob(os.path.join(path, pattern)))
        if found:
            return found
    raise FileNotFoundError(
        f"no weights in {path!r}: expected *.safetensors, a safetensors index or a *.gguf"
    )


def checkpoint_names(path: str, only: Callable[[str], bool] | None = None) -> list[str]:
    """The names of the safetensors tensors of the model at `path` (read from the headers only);
    `only`: those it accepts."""
    from safetensors import safe_open

    names: list[str] = []
    for file in checkpoint_files(path):
        if file.endswith(".safetensors"):
            with safe_open(file, framework="numpy") as f:
                names.extend(name for name in f.keys() if only is None or only(name))
    return names


def iter_checkpoint(
    path: str,
    *,
    int8_q8_0: bool = False,
    int4_q4: bool = False,
    only: Callable[[str], bool] | None = None,
    part: Callable[[str], Box | None] | None = None,
    q8_0_embedding: tuple[np.ndarray, np.ndarray] | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(hf_name, host array)` over every tensor of the model at `path` (`int8_q8_0`: a
    GGUF's Q8_0 linear weights as int8 weights and scales; `int4_q4`: an all-4-bit GGUF's
    projections as int4 values, scales and offsets: `gguf_reader.iter_hf_tensors`); `only`: the
    safetensors tensors it accepts, the others left unread; `part`: the box of a safetensors
    tensor to read (None: all of it), the rest of its array zeros, never read; `q8_0_embedding`: a
    GGUF's embedding blocks, read already (`gguf_reader.iter_hf_tensors`)."""
    for file in checkpoint_files(path):
        if file.endswith(".gguf"):
            yield from gguf_reader.iter_hf_tensors(
                file, int8_q8_0=int8_q8_0, int4_q4=int4_q4, q8_0_embedding=q8_0_embedding
            )
            continue
        from safetensors import safe_open

        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                if only is not None and not only(name):
                    continue
                box = None if part is None else part(name)
                if f.get_slice(name).get_dtype() == _FP8_SAFETENSORS_DTYPE:
                    yield name, _fp8_tensor(file, name)
                elif box is not None:
                    yield name, read_box(f, name, box)
                else:
                    yield name, f.get_tensor(name)


def read_tensors(path: str, suffix: str) -> dict[str, np.ndarray]:
    """The safetensors tensors of the model at `path` whose names end in `suffix` (small ones a
    loader reads before the rest: GPTQ's `g_idx`), by name."""
    from safetensors import safe_open

    found = {}
    for file in checkpoint_files(path):
        if file.endswith(".safetensors"):
            with safe_open(file, framework="numpy") as f:
                found |= {name: f.get_tensor(name) for name in f.keys() if name.endswith(suffix)}
    return found


# safetensors' name of float8_e4m3fn, which its NumPy reader cannot give (NumPy has no such type).
_FP8_SAFETENSORS_DTYPE = "F8_E4M3"


def _fp8_tensor(file: str, name: str) -> np.ndarray:
    """The float8_e4m3fn tensor `name` of the safetensors `file`, read from its bytes (the
    format's header: an 8-byte little-endian length, then JSON giving each tensor's shape and
    byte range after the header)."""
    with open(file, "rb") as f:
        (length,) = np.frombuffer(f.read(8), "<u8")
        entry = json.loads(f.read(int(length)))[name]
        start, end = entry["data_offsets"]
        f.seek(8 + int(length) + start)
        raw = np.frombuffer(f.read(end - start), np.uint8)
    return raw.view(FP8_DTYPE).reshape(entry["shape"])
