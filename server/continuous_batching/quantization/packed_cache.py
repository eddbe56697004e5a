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
entry. Entries of older versions of the same file are removed when a new one is written. A
damaged entry (sizes that do not add up, bad JSON) is ignored with a warning, never trusted.

``root``: ``load_cache.cache_root`` (``model_loading_config.load_cache_dir``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

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
    """The cache entry of one source file: ``get`` a cached weight (memory-mapped) or ``None``;
    ``put`` weights during a load that missed, then ``commit`` writes them all at once."""

    def __init__(self, source: Path, root: Path) -> None:
        self.source = source.resolve()
        self.folder = root / "packed" / f"{source.stem}-{source_key(source, _layout_version())}"
        self._pending: dict[str, PackedWeight] = {}
        self._entries: dict[str, dict[str, Any]] = {}
        self._data: np.ndarray | None = None
        self._open()

    @property
    def is_hit(self) -> bool:
        """True when the entry exists and was read (its weights come from disk)."""
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

    def put(self, name: str, weight: PackedWeight) -> None:
        """Keep ``weight`` for ``commit`` (only on a miss: a hit's entry is complete)."""
        if not self.is_hit:
            self._pending[name] = weight

    def commit(self) -> bool:
        """Write the weights ``put`` since a miss as this source's entry; False (with a
        warning) where the disk is full or not writable: the load goes on without a cache."""
        if self.is_hit or not self._pending:
            return False
        num_bytes = sum(_aligned(t.numel() * t.element_size()) for t in self._tensors())
        tmp = self.folder.with_name(f"{self.folder.name}.tmp{os.getpid()}")
        try:
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(self.folder.parent).free < num_bytes + _FREE_MARGIN:
                logger.warning(
                    "packed-weight cache not written: %.1f GiB needed in %s",
                    num_bytes / 2**30,
                    self.folder.parent,
                )
                return False
            self._write(tmp)
            self._remove_stale()
            # A damaged entry goes; a process that maps its file keeps the unlinked inode.
            shutil.rmtree(self.folder, ignore_errors=True)
            tmp.rename(self.folder)
        except OSError as error:
            logger.warning("packed-weight cache not written to %s: %s", self.folder, error)
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        logger.info("packed weights cached in %s (%.1f MiB)", self.folder, num_bytes / 2**20)
        return True

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
            self._data = np.memmap(data_file, dtype=np.uint8, mode="c")
            self._entries = index["entries"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("ignoring damaged packed-weight cache %s: %s", self.folder, error)
            self._data, self._entries = None, {}

    def _tensor(self, spec: dict[str, Any]) -> torch.Tensor:
        assert self._data is not None
        dtype = _DTYPES[spec["dtype"]]
        num_bytes = int(np.prod(spec["shape"])) * torch.empty((), dtype=dtype).element_size()
        raw = self._data[spec["offset"] : spec["offset"] + num_bytes]
        return torch.from_numpy(raw).view(dtype).view(spec["shape"])

    # -- writing -------------------------------------------------------------------------------
    def _tensors(self) -> list[torch.Tensor]:
        return [t for w in self._pending.values() for t in w.tensors() if t is not None]

    def _write(self, folder: Path) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        entries: dict[str, dict[str, Any]] = {}
        offset = 0
        with open(folder / _DATA, "wb") as out:
            for name, weight in self._pending.items():
                specs: dict[str, dict[str, Any] | None] = {}
                for field, tensor in zip(ROW_FIELDS, weight.tensors(), strict=True):
                    if tensor is None:
                        specs[field] = None
                        continue
                    raw = tensor.contiguous().view(torch.uint8).numpy()
                    out.write(raw.tobytes())
                    size = raw.nbytes
                    out.write(b"\0" * (_aligned(size) - size))
                    dtype = str(tensor.dtype).removeprefix("torch.")
                    specs[field] = {"dtype": dtype, "shape": list(tensor.shape), "offset": offset}
                    offset += _aligned(size)
                entries[name] = {
                    "source": weight.source,
                    "bits": weight.bits,
                    "group": weight.group,
                    "tensors": specs,
                }
        index = {"source": str(self.source), "num_bytes": offset, "entries": entries}
        (folder / _INDEX).write_text(json.dumps(index))

    def _remove_stale(self) -> None:
        """Entries of this source written before it changed (or by older code)."""
        prefix = f"{self.source.stem}-"
        for other in self.folder.parent.glob(f"{prefix}*"):
            index_file = other / _INDEX
            if other == self.folder or ".tmp" in other.name or not index_file.is_file():
                continue
            try:
                is_same_source = json.loads(index_file.read_text())["source"] == str(self.source)
            except (OSError, ValueError, KeyError):
                continue
            if is_same_source:
                shutil.rmtree(other, ignore_errors=True)


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN
