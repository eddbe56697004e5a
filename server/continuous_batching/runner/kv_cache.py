"""The paged KV cache's tensors: the device pool (plus one dummy block), the CPU swap pool, the
block copies the scheduler asks for. How big the device pool is: ``kv_memory``.

One layer's K (or V) cache is ``[num_blocks * block_size, kv_heads, head_dim]``: block ``b`` is
the contiguous rows ``b * block_size : (b + 1) * block_size``. A copy therefore moves row
ranges: the (src, dst) block pairs are coalesced into runs where both sides are consecutive
(``block_runs``), and each run is one slice copy per layer and K/V, with no index tensors.

On cuda, swaps run on a side stream between the device pool and a pinned CPU pool, and the
step's forward waits only on the swaps it needs (``KVCache.apply_block_ops``). On any other
device every copy is synchronous, in the order swap out, swap in, copy-on-write.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from itertools import chain

import torch

from server.continuous_batching.model.architecture import ModelArchConfig
from server.continuous_batching.model.llama import kv_bytes_per_block, kv_cache_shape
from server.continuous_batching.model.paged_attention import LayerCache
from server.continuous_batching.scheduling.block_manager import BlockOps

#: A coalesced copy: (first source block, first target block, number of blocks).
BlockRun = tuple[int, int, int]


# -- block copies -------------------------------------------------------------------------
def block_runs(pairs: Iterable[tuple[int, int]], is_same_pool: bool = False) -> list[BlockRun]:
    """Coalesce (src, dst) block pairs, in the order given, into ``(src_start, dst_start,
    num_blocks)`` runs: a pair extends the previous run when its src and its dst both come right
    after that run's last. With ``is_same_pool`` (source and target are one pool: copy-on-write)
    a run never grows into a copy whose source and target rows overlap."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs:
            run = runs[-1]
            src_start, dst_start, num_blocks = run
            is_next = src == src_start + num_blocks and dst == dst_start + num_blocks
            num_grown = num_blocks + 1
            is_overlapping = is_same_pool and (
                src_start < dst_start + num_grown and dst_start < src_start + num_grown
            )
            if is_next and not is_overlapping:
                run[2] = num_grown
                continue
        runs.append([src, dst, 1])
    return [(src_start, dst_start, num_blocks) for src_start, dst_start, num_blocks in runs]


def copy_block_runs(
    runs: list[BlockRun],
    source: list[LayerCache],
    target: list[LayerCache],
    block_size: int,
    non_blocking: bool,
) -> None:
    """Copy each run as one row slice per layer and K/V, on the current stream."""
    for src_start, dst_start, num_blocks in runs:
        src_rows = slice(src_start * block_size, (src_start + num_blocks) * block_size)
        dst_rows = slice(dst_start * block_size, (dst_start + num_blocks) * block_size)
        for (src_k, src_v), (dst_k, dst_v) in zip(source, target, strict=True):
            dst_k[dst_rows].copy_(src_k[src_rows], non_blocking=non_blocking)
            dst_v[dst_rows].copy_(src_v[src_rows], non_blocking=non_blocking)


def needs_swap_out_wait(
    swapped_out_device_blocks: Collection[int], step_block_ids: Collection[int]
) -> bool:
    """True when the step uses (reads or writes) a device block that a swap-out still copies
    from: the block was freed by the swap-out and handed to another sequence."""
    return any(block in step_block_ids for block in swapped_out_device_blocks)


def last_swap_out_to_wait(
    pending: Sequence[Collection[int]], step_block_ids: Iterable[int]
) -> int | None:
    """Index of the latest pending swap-out (oldest first: the device blocks each reads) that
    the step must wait for, or None. Swaps run in order on one stream, so waiting for that one
    covers every earlier one too."""
    if not pending:
        return None  # the usual case: the step's block ids are not even listed
    step = set(step_block_ids)
    for index in range(len(pending) - 1, -1, -1):
        if needs_swap_out_wait(pending[index], step):
            return index
    return None


# -- the pools ----------------------------------------------------------------------------
def allocate_kv_pool(
    arch: ModelArchConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    is_pinned: bool = False,
) -> list[LayerCache]:
    """Zeroed (K, V) caches of ``num_blocks`` blocks for every layer."""
    shape = kv_cache_shape(arch, num_blocks, block_size)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device, pin_memory=is_pinned),
            torch.zeros(shape, dtype=dtype, device=device, pin_memory=is_pinned),
        )
        for _ in range(arch.num_hidden_layers)
    ]


class KVCache:
    """The device pool (``num_blocks`` blocks and one dummy block after them), the CPU swap
    pool (pinned on cuda) and the block copies between them."""

    def __init__(
        self,
        arch: ModelArchConfig,
        num_blocks: int,
        num_blocks_cpu: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_blocks_cpu = num_blocks_cpu
        #: One block past the pool, never handed out: padded decode rows write there.
        self.dummy_block = num_blocks
        self.bytes_per_block = kv_bytes_per_block(arch, block_size, dtype)
        #: cuda: swaps on a side stream, copies issued without waiting. Else all synchronous.
        self.is_async = device.type == "cuda"
        self.kv_caches = allocate_kv_pool(arch, num_blocks + 1, block_size, dtype, device)
        cpu = torch.device("cpu")
        self.cpu_kv_caches = allocate_kv_pool(
            arch, num_blocks_cpu, block_size, dtype, cpu, is_pinned=self.is_async
        )
        self._swap_stream = torch.cuda.Stream(device) if self.is_async else None
        #: Swap-outs the compute stream has not waited for, oldest first: (their completion
        #: event, the device blocks they read).
        self._pending_swap_outs: list[tuple[torch.cuda.Event, frozenset[int]]] = []

    @property
    def device_bytes(self) -> int:
        """Bytes of the device pool, dummy block included."""
        return (self.num_blocks + 1) * self.bytes_per_block

    def _copy(
        self, pairs: Iterable[tuple[int, int]], source: list[LayerCache], target: list[LayerCache]
    ) -> None:
        runs = block_runs(pairs, is_same_pool=source is target)
        copy_block_runs(runs, source, target, self.block_size, non_blocking=self.is_async)

    @torch.inference_mode()
    def apply_block_ops(
        self, ops: BlockOps, step_block_tables: Sequence[Sequence[int]] = ()
    ) -> None:
        """Swap out, swap in, then copy-on-write, before the step's forward writes anything.

        ``step_block_tables``: the block tables of the sequences the step runs (none for a step
        that runs nothing). On cuda the forward (the compute stream) waits for this step's
        swap-ins, and for a swap-out only while it reads a block the step uses.
        """
        if not self.is_async:
            self._copy(ops.swap_out.items(), self.kv_caches, self.cpu_kv_caches)
            self._copy(ops.swap_in.items(), self.cpu_kv_caches, self.kv_caches)
            self._copy(ops.copy, self.kv_caches, self.kv_caches)
            return
        compute = torch.cuda.current_stream(self.kv_caches[0][0].device)
        if ops.swap_out or ops.swap_in:
            self._swap_on_side_stream(ops, compute)
        # Copy-on-write targets are written on the compute stream, like the forward's blocks.
        step_block_ids = chain(chain.from_iterable(step_block_tables), (d for _, d in ops.copy))
        self._wait_for_swap_outs(step_block_ids, compute)
        self._copy(ops.copy, self.kv_caches, self.kv_caches)

    def _swap_on_side_stream(self, ops: BlockOps, compute: torch.cuda.Stream) -> None:
        """GPU-ONLY: issue the swaps on the side stream; the compute stream waits for swap-ins."""
        side = self._swap_stream
        assert side is not None
        # Swap-outs read what earlier steps wrote; swap-ins overwrite blocks that earlier steps'
        # kernels may still read: start both after the work queued so far.
        side.wait_stream(compute)
        # A CPU block swapped out in one step and swapped in (or out again) in a later one
        # needs no event: both copies run on this one stream, in order.
        with torch.cuda.stream(side):
            if ops.swap_out:
                self._copy(ops.swap_out.items(), self.kv_caches, self.cpu_kv_caches)
                self._pending_swap_outs.append((side.record_event(), frozenset(ops.swap_out)))
            if ops.swap_in:
                self._copy(ops.swap_in.items(), self.cpu_kv_caches, self.kv_caches)
                swapped_in = side.record_event()
        if ops.swap_in:
            compute.wait_event(swapped_in)  # these sequences run in this step
            self._pending_swap_outs.clear()  # stream order: every earlier swap-out is done too

    def _wait_for_swap_outs(
        self, step_block_ids: Iterable[int], compute: torch.cuda.Stream
    ) -> None:
        """GPU-ONLY: make the compute stream wait for the latest swap-out still reading a
        device block that the step uses (a later step's too: a freed block is handed out
        again whenever the pool runs low)."""
        pending = [entry for entry in self._pending_swap_outs if not entry[0].query()]
        index = last_swap_out_to_wait([blocks for _, blocks in pending], step_block_ids)
        if index is not None:
            compute.wait_event(pending[index][0])
            pending = pending[index + 1 :]
        self._pending_swap_outs = pending
