"""One host-to-device copy per step: the step's integer arrays packed into one buffer.

On cuda, ``torch.tensor(values, device="cuda")`` copies from pageable memory, which makes the
host wait for the copy (and so for the GPU work queued before it); an eager step used to make
~26 such copies (token ids, positions, slots, per-group index tensors, masks, sample rows), each
a stall that kept the host from running ahead of the GPU. Here every array of the step is
written into one pinned host buffer at 8-byte-aligned offsets, copied with a single
``non_blocking`` copy, and viewed on the device as the typed tensors the forward reads.

On a CPU nothing needs copying: the arrays become tensors sharing their memory. The packing
itself is plain code that the CPU tests run (``is_packing=True``) against that path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: Offsets are multiples of the widest element type (int64), so every view is aligned.
_ALIGN = 8


def packed_offsets(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Byte offset of each array in the packed buffer, and the buffer's size."""
    offsets: list[int] = []
    total = 0
    for array in arrays:
        offsets.append(total)
        total += -(-array.nbytes // _ALIGN) * _ALIGN
    return offsets, total


class StepUploader:
    """Turns a step's numpy arrays into device tensors with one host-to-device copy."""

    def __init__(self, device: torch.device, is_packing: bool | None = None) -> None:
        """``is_packing``: pack and copy (default: on cuda only; tests turn it on on a CPU)."""
        self.device = device
        self.is_packing = device.type == "cuda" if is_packing is None else is_packing
        # Pinned memory makes the copy asynchronous; torch's caching host allocator keeps a
        # buffer out of reuse until the copy that reads it has finished.
        self._is_pinned = device.type == "cuda"

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors with the values, dtypes and shapes of ``arrays``, in order."""
        if not self.is_packing:
            return [torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in arrays]
        offsets, total = packed_offsets(arrays)
        host = torch.empty(total, dtype=torch.uint8, pin_memory=self._is_pinned)
        host_bytes = host.numpy()
        for array, offset in zip(arrays, offsets, strict=True):
            flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            host_bytes[offset : offset + flat.size] = flat
        packed = host.to(self.device, non_blocking=True)
        tensors = []
        for array, offset in zip(arrays, offsets, strict=True):
            dtype = torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
            part = packed[offset : offset + array.nbytes].view(dtype)
            tensors.append(part.view(array.shape))
        return tensors


class StaticDecodeBuffers:
    """The inputs a captured decode graph reads, as views of one device buffer that one copy
    per step fills: token ids, positions and slots (int64), context lengths and block tables
    (int32), ``num_rows`` rows each. The block tables come last, row after row, so a step of
    ``n`` rows copies only the buffer's prefix up to the end of table row ``n``."""

    def __init__(
        self,
        num_rows: int,
        max_blocks: int,
        block_size: int,
        dummy_block: int,
        device: torch.device,
    ) -> None:
        self.num_rows = num_rows
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.dummy_block = dummy_block
        self._is_pinned = device.type == "cuda"
        shapes: list[tuple[np.dtype, tuple[int, ...]]] = [
            (np.dtype(np.int64), (num_rows,)),  # input ids
            (np.dtype(np.int64), (num_rows,)),  # positions
            (np.dtype(np.int64), (num_rows,)),  # slot mapping
            (np.dtype(np.int32), (num_rows,)),  # context lengths
            (np.dtype(np.int32), (num_rows, max_blocks)),  # block tables
        ]
        templates = [np.empty(shape, dtype=dtype) for dtype, shape in shapes]
        self._offsets, total = packed_offsets(templates)
        self.buffer = torch.zeros(total, dtype=torch.uint8, device=device)
        views = [
            self.buffer[offset : offset + t.nbytes].view(torch.from_numpy(t).dtype).view(t.shape)
            for t, offset in zip(templates, self._offsets, strict=True)
        ]
        self.input_ids, self.positions, self.slot_mapping, self.context_lens = views[:4]
        self.block_tables = views[4]
        self.context_lens.fill_(1)
        self._staging = _StagingRing(total, is_pinned=self._is_pinned)

    def fill(
        self,
        input_ids: list[int],
        positions: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
    ) -> None:
        """Write a (padded) decode step into the first ``len(input_ids)`` rows, in one copy."""
        size = len(input_ids)
        if size > self.num_rows:
            raise ValueError(f"{size} rows do not fit {self.num_rows} static rows")
        num_bytes = self._offsets[4] + size * self.max_blocks * 4
        staging = self._staging.acquire()[:num_bytes]
        host = staging.numpy()

        def region(index: int, dtype: type, count: int) -> np.ndarray:
            start = self._offsets[index]
            return host[start : start + count * np.dtype(dtype).itemsize].view(dtype)

        table = region(4, np.int32, size * self.max_blocks).reshape(size, self.max_blocks)
        table.fill(self.dummy_block)
        for row, blocks in enumerate(block_tables):
            table[row, : len(blocks)] = blocks
        pos = np.asarray(positions, dtype=np.int64)
        region(0, np.int64, size)[:] = input_ids
        region(1, np.int64, size)[:] = pos
        blocks_of_rows = table[np.arange(size), pos // self.block_size].astype(np.int64)
        region(2, np.int64, size)[:] = blocks_of_rows * self.block_size + pos % self.block_size
        region(3, np.int32, size)[:] = context_lens
        for index, dtype in enumerate((np.int64, np.int64, np.int64, np.int32)):
            region(index, dtype, self.num_rows)[size:] = 0  # rows past the step, as before
        self.buffer[:num_bytes].copy_(staging, non_blocking=True)
        self._staging.release()


class _StagingRing:
    """A few host buffers that step copies take turns with, so that no step allocates.

    A fresh pinned tensor per step (even from torch's caching host allocator) cost about 4 ms
    of host time per step at 256 rows on an H200, half of the step. A buffer is reused only
    once the copy that last read it has finished (its event), which with several buffers in
    the ring has almost always happened already. Each step writes every value the graphs read, so
    the buffers need no zeroing."""

    def __init__(self, num_bytes: int, is_pinned: bool, num_buffers: int = 4) -> None:
        # On a CPU the copy is synchronous: one buffer, no events.
        count = num_buffers if is_pinned else 1
        self._buffers = [
            torch.empty(num_bytes, dtype=torch.uint8, pin_memory=is_pinned) for _ in range(count)
        ]
        self._events: list[torch.cuda.Event | None] = [None] * count
        self._is_pinned = is_pinned
        self._index = 0

    def acquire(self) -> torch.Tensor:
        """The next buffer, once the copy that last read it has run."""
        event = self._events[self._index]
        if event is not None:
            event.synchronize()
        return self._buffers[self._index]

    def release(self) -> None:
        """Marks the current buffer as read by the copy just queued, and moves on."""
        if self._is_pinned:
            event = self._events[self._index] or torch.cuda.Event()
            event.record()
            self._events[self._index] = event
        self._index = (self._index + 1) % len(self._buffers)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. On cuda it goes through pinned memory with an asynchronous
    copy: a copy from pageable memory would make the host wait for the GPU."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device(
    values: list[int] | list[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A small host list as a tensor on ``device`` (see :func:`host_to_device`)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)
