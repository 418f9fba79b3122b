# SPDX-License-Identifier: Apache-2.0
"""A GGUF file's metadata and tensor views, read in one pass.

The `gguf` package's reader builds a NumPy view for every element of every metadata array (a
tokenizer's tens of thousands of tokens and merges make that slow); this reader decodes scalars with
`struct`, numeric arrays with one `np.frombuffer` and string arrays in one loop, and maps the
tensors without copying. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Metadata value types: code -> struct format (scalars) or NumPy dtype (array elements).
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GgufTensor:
    """One tensor: its GGML type, logical shape (outermost first) and raw data (a view)."""

    name: str
    ggml_type: int  # a `gguf.GGMLQuantizationType`
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 bytes for quantized types, else the element dtype


@dataclasses.dataclass(frozen=True)
class GgufFile:
    """Metadata key -> value (arrays as lists) and the tensors, in file order."""

    fields: dict[str, Any]
    tensors: tuple[GgufTensor, ...]
    header_bytes: int = 0  # the header, metadata and tensor table: where the tensor data starts

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Cursor:
    def __init__(self, buffer: np.ndarray):
        self.buffer = buffer
        self.offset = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        text = bytes(self.buffer[self.offset : self.offset + length]).decode("utf-8", errors="replace")
        self.offset += length
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        if kind not in _SCALARS:
            raise ValueError(f"GGUF metadata value type {kind} at byte {self.offset} is unknown")
        return self.scalar(_SCALARS[kind])

    def array(self) -> list[Any]:
        kind, count = self.scalar("<I"), self.scalar("<Q")
        if kind in _SCALARS:
            dtype = np.dtype(_SCALARS[kind])
            values = np.frombuffer(self.buffer, dtype, count, self.offset)
            self.offset += dtype.itemsize * count
            return values.tolist()
        return [self.value(kind) for _ in range(count)]


def read_gguf(path: str) -> GgufFile:
    """Reads `path`'s metadata and maps its tensors (read-only views of the file)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(buffer)
    if bytes(buffer[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic number)")
    cursor.offset = 4
    version, tensor_count, field_count = cursor.scalar("<I"), cursor.scalar("<Q"), cursor.scalar("<Q")
    if version < 2:
        raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are supported")
    fields = {}
    for _ in range(field_count):
        key = cursor.string()
        fields[key] = cursor.value(cursor.scalar("<I"))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
        infos.append((name, tuple(reversed(dims)), cursor.scalar("<I"), cursor.scalar("<Q")))
    alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, shape, type_code, offset in infos:
        ggml_type = GGMLQuantizationType(type_code)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        nbytes = int(np.prod(shape)) * type_size // block_size
        raw = buffer[start + offset : start + offset + nbytes]
        if ggml_type.name in _PLAIN_TYPES:  # as the `gguf` package's reader: a typed view
            data = raw.view(_PLAIN_TYPES[ggml_type.name]).reshape(shape)
        else:  # quantized (and bfloat16): bytes, as `gguf.quants.dequantize` takes them
            data = raw.reshape(quant_shape_to_byte_shape(shape, ggml_type))
        tensors.append(GgufTensor(name, ggml_type, shape, data))
    return GgufFile(fields, tuple(tensors), header_bytes=start)


def content_key(path: str) -> str:
    """A hash of what identifies a GGUF file's model: its size, header, metadata and tensor table
    (names, shapes, types, offsets), for naming what is derived from it; the tensor data itself is
    not read."""
    header = read_gguf(path).header_bytes
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f"{os.fstat(f.fileno()).st_size}\n".encode())
        digest.update(f.read(header))
    return digest.hexdigest()
