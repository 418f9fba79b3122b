# SPDX-License-Identifier: Apache-2.0
"""Our one-pass GGUF reader against the `gguf` package's own reader: a file written with every
metadata type, plain and quantized tensors and a custom alignment, and the embedded model."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from models.gguf_file import read_gguf
from plugin_shim.model_dir import embedded_gguf_path


def _assert_same_as_gguf_reader(path: str) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    expected = {
        name: field.contents() for name, field in theirs.fields.items() if not name.startswith("GGUF.")
    }
    assert ours.fields.keys() == expected.keys()
    for key, value in expected.items():
        assert (
            ours.fields[key] == pytest.approx(value)
            if isinstance(value, float)
            else ours.fields[key] == value
        )
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.ggml_type == reference.tensor_type
        assert mine.shape == tuple(reversed(reference.shape.tolist()))
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        np.testing.assert_array_equal(mine.data, reference.data)


def test_every_metadata_type_and_tensor_kind_read_as_the_gguf_package_reads_them(tmp_path):
    path = str(tmp_path / "all.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int16("t.i16", -3)
    writer.add_uint64("t.u64", 2**40)
    writer.add_float32("t.f32", 0.25)
    writer.add_float64("t.f64", -1e-7)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ünïcode"])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((2, 7)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("quant", q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_same_as_gguf_reader(path)
    gguf_file = read_gguf(path)
    assert gguf_file.field("t.strs") == ["a", "", "ünïcode"] and gguf_file.field("t.missing", 7) == 7
    assert gguf_file.tensors[2].shape == (4, 64)


@pytest.mark.slow  # the embedded model's whole file; every metadata type and tensor kind stays fast
def test_embedded_model_read_as_the_gguf_package_reads_it():
    _assert_same_as_gguf_reader(embedded_gguf_path())


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match=r"model.bin is not a GGUF file"):
        read_gguf(str(path))


def _small_gguf(path, *, label: str, rows: int = 3) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", label)
    writer.add_tensor("weight", np.ones((rows, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_gguf_model_directory_is_named_by_content_not_only_by_file_name(tmp_path, monkeypatch):
    """Two files of one name (another model, or a file replaced in place) get their own model
    directory: the name carries a hash of the size, metadata and tensor table."""
    import plugin_shim.model_dir as model_dir

    monkeypatch.setattr(model_dir, "_write_model_dir", _record)
    for name in "abcd":
        (tmp_path / name).mkdir()
    first = _small_gguf(tmp_path / "a" / "model.gguf", label="first")
    other_metadata = _small_gguf(tmp_path / "b" / "model.gguf", label="other")
    other_tensors = _small_gguf(tmp_path / "c" / "model.gguf", label="first", rows=5)
    same = _small_gguf(tmp_path / "d" / "model.gguf", label="first")
    cache = str(tmp_path / "cache")
    built = [model_dir.materialize(cache, path) for path in (first, other_metadata, other_tensors, same)]
    assert len(set(built[:3])) == 3 and built[3] == built[0]
    assert all(os.path.basename(b).startswith("model-") for b in built)
    for directory, source in zip(built[:3], (first, other_metadata, other_tensors), strict=True):
        assert open(os.path.join(directory, "source")).read() == source  # each from its own file


def _record(directory: str, source: str) -> None:
    import plugin_shim.model_dir as model_dir

    with open(os.path.join(directory, "source"), "w") as f:
        f.write(source)
    open(os.path.join(directory, model_dir._DONE_MARKER), "w").close()
