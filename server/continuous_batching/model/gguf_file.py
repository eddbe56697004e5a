"""A GGUF file's metadata and tensor index, read in well under a second.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata value, so a file
carrying a tokenizer (49k-128k token strings, as many merges) takes 5-20 s to open before a
single weight is read. The model loader needs a few dozen scalar keys and the tensor table:
this reader decodes scalars and numeric arrays at once, walks past string arrays (kept as
byte ranges, decoded only when asked for) and memory-maps the tensor data, giving each
tensor the same numpy view ``GGUFReader`` would (so ``gguf.quants.dequantize`` takes it).

Little-endian GGUF v2/v3 only (what llama.cpp writes on every common machine); others are
refused with a clear error.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC

_SCALARS: dict[int, str] = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_STRING, _ARRAY = 8, 9
#: Tensor types stored as plain numbers (``GGUFReader`` gives them their own dtype).
_PLAIN_TYPES: dict[GGMLQuantizationType, type] = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands (bad magic, version, byte order)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in GGML order ([in, out] for a matrix), ``data`` a read-only
    view of the mapped file shaped as ``GGUFReader`` shapes it (quantised types: uint8
    [rows, bytes per row])."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class _Strings:
    """A string array left undecoded: where its items start and how many there are."""

    offset: int
    count: int


class GGUFFile:
    """A memory-mapped GGUF file: ``value(key)`` for metadata, ``tensors`` in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        magic, version = self._unpack("<II")
        if magic != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path} is not a GGUF file (bad magic)")
        if version not in (2, 3):
            raise GGUFFormatError(
                f"{self.path}: GGUF version {version} (big-endian or unknown) is not supported"
            )
        num_tensors, num_kv = self._unpack("<QQ")
        self._values: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            (value_type,) = self._unpack("<I")
            self._values[key] = self._value(value_type)
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self._values.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: list[GGUFTensor] = [self._tensor(data_start, *info) for info in infos]

    # -- metadata ----------------------------------------------------------------------------
    def value(self, key: str, default: Any = None) -> Any:
        """The metadata value of ``key`` (a number, string, or list), or ``default``."""
        if key not in self._values:
            return default
        value = self._values[key]
        return self._decode_strings(value) if isinstance(value, _Strings) else value

    def keys(self) -> list[str]:
        """Every metadata key, in file order."""
        return list(self._values)

    # -- parsing -------------------------------------------------------------------------------
    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        start = self._pos
        self._pos += length
        return self._map[start : self._pos].decode("utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type in _SCALARS:
            return self._unpack("<" + _SCALARS[value_type])[0]
        if value_type != _ARRAY:
            raise GGUFFormatError(f"{self.path}: unknown metadata type {value_type}")
        item_type, count = self._unpack("<IQ")
        if item_type == _STRING:
            strings = _Strings(self._pos, count)
            for _ in range(count):  # lengths only: no string is decoded here
                (length,) = struct.unpack_from("<Q", self._map, self._pos)
                self._pos += 8 + length
            return strings
        if item_type in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[item_type])
            items = np.frombuffer(self._map, dtype, count, self._pos)
            self._pos += dtype.itemsize * count
            return items.tolist()
        return [self._value(item_type) for _ in range(count)]  # nested arrays (rare)

    def _decode_strings(self, strings: _Strings) -> list[str]:
        pos, items = strings.offset, []
        for _ in range(strings.count):
            (length,) = struct.unpack_from("<Q", self._map, pos)
            items.append(self._map[pos + 8 : pos + 8 + length].decode("utf-8"))
            pos += 8 + length
        return items

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (num_dims,) = self._unpack("<I")
        shape = self._unpack(f"<{num_dims}Q")
        raw_type, offset = self._unpack("<IQ")
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            message = f"{self.path}: tensor {name} has unknown type {raw_type}"
            raise GGUFFormatError(message) from None
        return name, tuple(int(d) for d in shape), tensor_type, int(offset)

    def _tensor(
        self,
        data_start: int,
        name: str,
        shape: tuple[int, ...],
        kind: GGMLQuantizationType,
        at: int,
    ) -> GGUFTensor:
        num_elements = int(np.prod(shape))
        block_size, type_size = GGML_QUANT_SIZES[kind]
        dims = tuple(reversed(shape))
        if kind in _PLAIN_TYPES:
            dtype, count = np.dtype(_PLAIN_TYPES[kind]), num_elements
        else:
            # Quantised (and BF16): bytes, one row of blocks per row.
            dtype, count = np.dtype(np.uint8), num_elements * type_size // block_size
            dims = (*dims[:-1], dims[-1] // block_size * type_size)
        end = data_start + at + count * dtype.itemsize
        if end > len(self._map):
            raise GGUFFormatError(f"{self.path}: tensor {name} runs past the end of the file")
        data = np.frombuffer(self._map, dtype, count, data_start + at).reshape(dims)
        return GGUFTensor(name, kind, shape, data)
