"""Packed weights cached on disk, so a quantised checkpoint is repacked once, not at every start.

The first load of a file repacks its tensors (``packed_gguf.repack``: seconds per GB) and
writes them here; later loads memory-map them: no repacking, no copy, and the pages belong to
the page cache, shared by every process serving the same file and reclaimable under pressure
(as llama.cpp's mmap).

One entry per source file, in ``<root>/packed/<file stem>-<key>/``:

* ``weights.bin``: every tensor's bytes, each at a 64-byte aligned offset;
* ``index.json``: per entry (a GGUF tensor name), its ``PackedWeight`` fields and where each
  tensor lies; written last, so an entry without it is an unfinished write and is ignored.

The key hashes the source's resolved path, size and modification time, and the code that
decides the layout (``LAYOUT_SOURCES``): a changed file or a new packing never meets an old
entry. Entries of older versions of the same file, and of files that no longer exist, are
removed when a new one is written. A
damaged entry (sizes that do not add up, bad JSON) is ignored with a warning, never trusted.

``root``: ``load_cache.cache_root`` (``model_loading_config.load_cache_dir``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from ..load_cache import source_key
from .packed_gguf import ROW_FIELDS, PackedWeight

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
#: The code whose changes change what a cached weight holds.
LAYOUT_SOURCES: tuple[Path, ...] = (
    _HERE / "packed_gguf.py",
    _HERE / "packed_cache.py",
    _HERE.parent / "model" / "weights_gguf_packed.py",
)
_INDEX, _DATA = "index.json", "weights.bin"
_ALIGN = 64
#: Room left free on the disk beyond the entry itself.
_FREE_MARGIN = 1 << 30
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.uint8, torch.int8, torch.float16, torch.float32, torch.int16, torch.int32)
}


def _layout_version() -> str:
    digest = hashlib.sha256()
    for path in LAYOUT_SOURCES:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class PackedCache:
    """The cache entry of one source file. On a hit ``get`` maps each weight from it. On a
    miss the loader writes the entry first (``begin``, ``put`` per weight as it is repacked,
    ``commit``), so repacked weights are never all held in memory at once; after ``commit``
    ``get`` maps them as on a hit. Where the entry cannot be written ``get`` gives None and
    the loader repacks."""

    def __init__(self, source: Path, root: Path) -> None:
        self.source = source.resolve()
        self.folder = root / "packed" / f"{source.stem}-{source_key(source, _layout_version())}"
        self._entries: dict[str, dict[str, Any]] = {}
        self._data: np.ndarray | None = None
        self._map: mmap.mmap | None = None  # behind _data
        self._tmp = self.folder.with_name(f"{self.folder.name}.tmp{os.getpid()}")
        self._out: BinaryIO | None = None
        self._offset = 0
        self._open()

    @property
    def is_hit(self) -> bool:
        """True when the entry is mapped (found at start, or written by ``commit``)."""
        return self._data is not None

    def get(self, name: str) -> PackedWeight | None:
        """The cached weight ``name`` (tensors map the file: no copy), or None."""
        entry = self._entries.get(name)
        if entry is None or self._data is None:
            return None
        tensors = {
            field: None if spec is None else self._tensor(spec)
            for field, spec in entry["tensors"].items()
        }
        return PackedWeight(entry["source"], bits=entry["bits"], group=entry["group"], **tensors)

    def begin(self, num_bytes: int) -> bool:
        """Start writing the entry (about ``num_bytes``); False, with a warning, where the disk
        has no room for it or cannot be written."""
        if self.is_hit:
            return False
        try:
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(self.folder.parent).free < num_bytes + _FREE_MARGIN:
                logger.warning(
                    "packed-weight cache not written: %.1f GiB needed in %s",
                    num_bytes / 2**30,
                    self.folder.parent,
                )
                return False
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp.mkdir()
            self._out = open(self._tmp / _DATA, "wb")  # noqa: SIM115 - closed by commit/_abort
        except OSError as error:
            self._abort(error)
            return False
        return True

    def put(self, name: str, weight: PackedWeight) -> None:
        """Append ``weight`` to the entry being written (a no-op once writing failed). The
        cache holds the plain layout: tiles are made after loading, for the build at hand."""
        if weight.is_lane_tiled:
            raise ValueError("the packed cache holds untiled weights")
        if self._out is None:
            return
        specs: dict[str, dict[str, Any] | None] = {}
        try:
            for field, tensor in zip(ROW_FIELDS, weight.tensors(), strict=True):
                specs[field] = None if tensor is None else self._append(tensor)
        except OSError as error:
            self._abort(error)
            return
        self._entries[name] = {
            "source": weight.source,
            "bits": weight.bits,
            "group": weight.group,
            "tensors": specs,
        }

    def commit(self) -> bool:
        """Finish the entry written since ``begin`` and map it; False (with a warning) where
        writing failed."""
        if self._out is None:
            return False
        try:
            self._out.close()
            self._out = None
            index = {"source": str(self.source), "num_bytes": self._offset}
            (self._tmp / _INDEX).write_text(json.dumps({**index, "entries": self._entries}))
            self._remove_stale()
            # A damaged entry goes; a process that maps its file keeps the unlinked inode.
            shutil.rmtree(self.folder, ignore_errors=True)
            self._tmp.rename(self.folder)
        except OSError as error:
            self._abort(error)
            return False
        logger.info("packed weights cached in %s (%.1f MiB)", self.folder, self._offset / 2**20)
        self._open()
        return self.is_hit

    def release_pages(self) -> None:
        """Unmap the pages this process touched (the file's pages stay in the page cache).
        Weights tiled at load (``lane_tiles``) were read once and copied: their mapped pages
        would otherwise count in the process's memory beside the tiles. Tensors still mapped
        (an embedding table, untiled weights) fault their pages back in from the page cache."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    # -- reading -------------------------------------------------------------------------------
    def _open(self) -> None:
        index_file, data_file = self.folder / _INDEX, self.folder / _DATA
        if not index_file.is_file() or not data_file.is_file():
            return
        try:
            index = json.loads(index_file.read_text())
            if index["num_bytes"] != data_file.stat().st_size or index["source"] != str(
                self.source
            ):
                raise ValueError("the index does not describe this data")
            # Copy-on-write: the arrays are writable for torch, never written, so every page
            # stays the file's (shared, reclaimable).
            with data_file.open("rb") as file:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
            self._data = np.frombuffer(self._map, dtype=np.uint8)
            self._entries = index["entries"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("ignoring damaged packed-weight cache %s: %s", self.folder, error)
            self._data, self._map, self._entries = None, None, {}

    def _tensor(self, spec: dict[str, Any]) -> torch.Tensor:
        assert self._data is not None
        dtype = _DTYPES[spec["dtype"]]
        num_bytes = int(np.prod(spec["shape"])) * torch.empty((), dtype=dtype).element_size()
        raw = self._data[spec["offset"] : spec["offset"] + num_bytes]
        return torch.from_numpy(raw).view(dtype).view(spec["shape"])

    # -- writing -------------------------------------------------------------------------------
    def _append(self, tensor: torch.Tensor) -> dict[str, Any]:
        assert self._out is not None
        raw = tensor.contiguous().view(torch.uint8).numpy()
        self._out.write(raw.data)
        self._out.write(b"\0" * (_aligned(raw.nbytes) - raw.nbytes))
        spec = {
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "offset": self._offset,
        }
        self._offset += _aligned(raw.nbytes)
        return spec

    def _abort(self, error: OSError) -> None:
        logger.warning("packed-weight cache not written to %s: %s", self.folder, error)
        if self._out is not None:
            self._out.close()
            self._out = None
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._entries, self._offset = {}, 0

    def _remove_stale(self) -> None:
        """Entries of this source written before it changed (or by older code), and entries
        whose source file is gone (a deleted or moved model)."""
        for other in self.folder.parent.iterdir():
            index_file = other / _INDEX
            if other == self.folder or ".tmp" in other.name or not index_file.is_file():
                continue
            try:
                source = json.loads(index_file.read_text())["source"]
            except (OSError, ValueError, KeyError):
                continue
            if source == str(self.source) or not Path(source).exists():
                shutil.rmtree(other, ignore_errors=True)


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN
