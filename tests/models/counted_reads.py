# SPDX-License-Identifier: Apache-2.0
"""What a load reads from a checkpoint, counted from outside the loader. Safetensors: within
`counting_reads()`, every tensor read whole (`safe_open(...).get_tensor`), in part (a
`get_slice(...)[...]`) or as raw fp8 bytes (`models.checkpoint_reads._fp8_tensor`) adds its bytes
under its name. GGUF: within `counting_gguf_reads()`, every tensor decoded adds its bytes. Headers
(names, shapes, dtypes) are not counted: they hold no weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np


class _CountedSlice:
    def __init__(self, part, name: str, read: dict[str, int]) -> None:
        self._part, self._name, self._read = part, name, read

    def __getitem__(self, index):
        value = self._part[index]
        self._read[self._name] = self._read.get(self._name, 0) + np.asarray(value).nbytes
        return value

    def __getattr__(self, attribute: str):  # get_dtype, get_shape: the header
        return getattr(self._part, attribute)


class _CountedFile:
    def __init__(self, handle, read: dict[str, int]) -> None:
        self._handle, self._read = handle, read

    def __enter__(self) -> _CountedFile:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._handle.__exit__(*exc)

    def get_tensor(self, name: str) -> np.ndarray:
        value = self._handle.get_tensor(name)
        self._read[name] = self._read.get(name, 0) + value.nbytes
        return value

    def get_slice(self, name: str) -> _CountedSlice:
        return _CountedSlice(self._handle.get_slice(name), name, self._read)

    def __getattr__(self, attribute: str):  # keys, metadata
        return getattr(self._handle, attribute)


@contextlib.contextmanager
def counting_reads() -> Iterator[dict[str, int]]:
    """The bytes read of each checkpoint tensor, by name, while the block runs."""
    import safetensors

    from models import checkpoint_reads

    read: dict[str, int] = {}
    opened, fp8_tensor = safetensors.safe_open, checkpoint_reads._fp8_tensor

    def fp8_counted(file: str, name: str) -> np.ndarray:
        value = fp8_tensor(file, name)
        read[name] = read.get(name, 0) + value.nbytes
        return value

    safetensors.safe_open = lambda *args, **kwargs: _CountedFile(opened(*args, **kwargs), read)
    checkpoint_reads._fp8_tensor = fp8_counted
    try:
        yield read
    finally:
        safetensors.safe_open, checkpoint_reads._fp8_tensor = opened, fp8_tensor


class _Named(np.ndarray):
    """A GGUF tensor's data that knows the tensor's name (views keep it)."""

    tensor_name: str | None = None

    def __array_finalize__(self, obj) -> None:
        self.tensor_name = getattr(obj, "tensor_name", None)


@contextlib.contextmanager
def counting_gguf_reads() -> Iterator[dict[str, int]]:
    """The bytes of each GGUF tensor decoded, by its GGUF name, while the block runs: every call
    of the decoders that read a tensor's data (`gguf.quants.dequantize`, `gguf_reader.q8_0_blocks`
    and `q4_blocks`) on a file that `gguf_reader` opened adds the tensor's bytes."""
    import dataclasses

    import gguf.quants

    from models import gguf_reader

    read: dict[str, int] = {}
    opened, q8_0_blocks, q4_blocks = gguf_reader.read_gguf, gguf_reader.q8_0_blocks, gguf_reader.q4_blocks
    dequantize = gguf.quants.dequantize

    def named(path: str):
        file = opened(path)
        views = [dataclasses.replace(t, data=t.data.view(_Named)) for t in file.tensors]
        for view, tensor in zip(views, file.tensors, strict=True):
            view.data.tensor_name = tensor.name
        return dataclasses.replace(file, tensors=tuple(views))

    def counted(decode):
        def run(data, *args, **kwargs):
            name = getattr(data, "tensor_name", None)
            if name is not None:
                read[name] = read.get(name, 0) + data.nbytes
            return decode(data, *args, **kwargs)

        return run

    gguf_reader.read_gguf = named
    gguf_reader.q8_0_blocks, gguf_reader.q4_blocks = counted(q8_0_blocks), counted(q4_blocks)
    gguf.quants.dequantize = counted(dequantize)
    try:
        yield read
    finally:
        gguf_reader.read_gguf, gguf_reader.q8_0_blocks, gguf_reader.q4_blocks = opened, q8_0_blocks, q4_blocks
        gguf.quants.dequantize = dequantize


def gguf_tensor_bytes(file: str) -> dict[str, int]:
    """Each tensor's size in bytes in the GGUF `file`, from its tensor table."""
    from models.gguf_file import read_gguf

    return {t.name: t.data.nbytes for t in read_gguf(file).tensors}


def tensor_bytes(path: str) -> dict[str, int]:
    """Each tensor's size in bytes in the safetensors files of the model at `path`, from their
    headers (the reference the counted reads are held to)."""
    import json
    import struct

    from models.checkpoint_reads import checkpoint_files

    sizes = {}
    for file in checkpoint_files(path):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        sizes |= {
            n: e["data_offsets"][1] - e["data_offsets"][0] for n, e in header.items() if n != "__metadata__"
        }
    return sizes
