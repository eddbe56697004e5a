"""``GGUFFile``, our fast GGUF index, against the ``gguf`` package's own ``GGUFReader`` on a file
with every metadata type and tensors of plain and quantised types; and its refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from server.continuous_batching.model.gguf_file import GGUFFile, GGUFFormatError
from tests.support.gguf_files import random_blocks


def _write(path: Path) -> Path:
    rng = np.random.default_rng(3)
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.125)
    writer.add_float64("t.f64", 1e-300)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strings", ["a", "", "Ġthe", "ü" * 40])
    writer.add_array("t.empty", [])
    writer.add_key_value("t.nested", [[1, 2], [3]], GGUFValueType.ARRAY)
    writer.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((5,)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for qtype in (T.Q8_0, T.Q4_K, T.Q6_K):
        writer.add_tensor(qtype.name, random_blocks(qtype, 4, 512, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_matches_gguf_reader(tmp_path: Path) -> None:
    path = _write(tmp_path / "all.gguf")
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert ours.keys() == keys
    for key in keys:
        if key != "t.nested":  # GGUFReader flattens nested arrays; ours keeps their shape
            assert ours.value(key) == theirs.fields[key].contents(), key
    assert ours.value("t.strings") == ["a", "", "Ġthe", "ü" * 40]
    assert ours.value("t.nested") == [[1, 2], [3]]
    assert ours.value("missing", 17) == 17
    assert len(ours.tensors) == len(theirs.tensors) == 6
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.name == reference.name
        assert mine.tensor_type == reference.tensor_type
        assert mine.shape == tuple(reference.shape.tolist())
        assert mine.data.dtype == reference.data.dtype
        assert mine.data.shape == reference.data.shape
        np.testing.assert_array_equal(mine.data, reference.data)
        assert not mine.data.flags.writeable  # a view of the mapped file, never a copy


def test_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    path = _write(tmp_path / "all.gguf")
    raw = path.read_bytes()
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGML" + raw[4:])
    with pytest.raises(GGUFFormatError, match="not a GGUF"):
        GGUFFile(bad_magic)
    big_endian = tmp_path / "big.gguf"
    big_endian.write_bytes(raw[:4] + (3).to_bytes(4, "big") + raw[8:])
    with pytest.raises(GGUFFormatError, match="version"):
        GGUFFile(big_endian)
    truncated = tmp_path / "short.gguf"
    truncated.write_bytes(raw[: len(raw) - 300])
    with pytest.raises(GGUFFormatError, match="past the end"):
        GGUFFile(truncated)
