"""Paged KV-cache bookkeeping: block pools with reference counts, copy-on-write, swapping
and prefix caching. Plain Python; the model runner does the actual copies it is told to.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from server.continuous_batching.sequence import Sequence


class OutOfBlocksError(RuntimeError):
    """A pool had no block left; the scheduler checks capacity first, so this is a bug."""


class BlockPool:
    """A fixed set of block ids with reference counts.

    With prefix caching, a block whose count drops to zero but holds a registered full block
    of tokens is kept as *evictable* (least recently used first) instead of freed: a later
    request with the same prefix takes it back without recomputing it.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of_block: dict[int, int] = {}
        self._block_of_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    def allocate(self) -> int:
        """A block with reference count 1 (evicting the least recently used cached block)."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of_hash[self._hash_of_block.pop(block)]
        else:
            raise OutOfBlocksError("no free KV block")
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more user of ``block``."""
        if self.ref_counts[block] == 0:
            self._evictable.pop(block, None)
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        """One user fewer; at zero the block is freed or kept as evictable cache."""
        count = self.ref_counts[block] - 1
        if count < 0:
            raise RuntimeError(f"block {block} freed twice")
        self.ref_counts[block] = count
        if count == 0:
            if block in self._hash_of_block:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def lookup(self, content_hash: int) -> int | None:
        """The block holding ``content_hash``, if cached."""
        return self._block_of_hash.get(content_hash)

    def register(self, block: int, content_hash: int) -> None:
        """Remember that ``block`` (full, never written again) holds ``content_hash``."""
        if content_hash in self._block_of_hash or block in self._hash_of_block:
            return  # the same content already has a block, or this block has its hash
        self._block_of_hash[content_hash] = block
        self._hash_of_block[block] = content_hash

    def is_all_free(self) -> bool:
        """True when no block is referenced (leak check for tests)."""
        return self.num_free == self.num_blocks and not any(self.ref_counts)


@dataclass
class BlockOps:
    """Copies the model runner must do before the step's forward, in this order."""

    swap_out: dict[int, int] = field(default_factory=dict)  # device block -> cpu block
    swap_in: dict[int, int] = field(default_factory=dict)  # cpu block -> device block
    copy: list[tuple[int, int]] = field(default_factory=list)  # device src -> device dst (CoW)

    def merge(self, other: BlockOps) -> None:
        """Add ``other``'s operations to these."""
        self.swap_out.update(other.swap_out)
        self.swap_in.update(other.swap_in)
        self.copy.extend(other.copy)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Maps sequences to KV blocks on the device and, when swapped out, in the CPU pool."""

    def __init__(
        self,
        num_blocks: int,
        num_blocks_cpu: int,
        block_size: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_blocks)
        self.cpu = BlockPool(num_blocks_cpu)
        self.num_watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.num_prefix_hit_tokens = 0  # prompt tokens served from the prefix cache

    # -- capacity -------------------------------------------------------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return _ceil_div(num_tokens, self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Device blocks ``seq`` needs to compute ``num_new_tokens`` more tokens."""
        total = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        needed = max(0, total - len(seq.block_table))
        first_write = seq.num_computed_tokens // self.block_size
        if first_write < len(seq.block_table):
            if self.device.ref_counts[seq.block_table[first_write]] > 1:
                needed += 1  # the partly filled last block is shared: copy on write
        return needed

    def can_allocate(self, num_blocks: int, is_admission: bool) -> bool:
        """True if ``num_blocks`` can be taken; admissions leave the watermark free."""
        reserve = self.num_watermark_blocks if is_admission else 0
        return self.device.num_free - num_blocks >= reserve

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for ``num_new_tokens`` more tokens; returns copy-on-write (src, dst) pairs."""
        copies = []
        first_write = seq.num_computed_tokens // self.block_size
        if first_write < len(seq.block_table):
            block = seq.block_table[first_write]
            if self.device.ref_counts[block] > 1:
                new_block = self.device.allocate()
                self.device.decref(block)
                seq.block_table[first_write] = new_block
                copies.append((block, new_block))
        total = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < total:
            seq.block_table.append(self.device.allocate())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks."""
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self.device.incref(block)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (device or CPU, wherever they are)."""
        pool = self.cpu if seq.is_swapped else self.device
        for block in seq.block_table:
            pool.decref(block)
        seq.block_table = []
        seq.num_registered_blocks = 0

    # -- prefix caching ---------------------------------------------------------------------
    def _block_hash(self, seq: Sequence, index: int) -> int:
        start = index * self.block_size
        parent = seq.block_hashes[index - 1] if index else 0
        return hash((parent, tuple(seq.token_ids[start : start + self.block_size])))

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        while len(seq.block_hashes) < num_full_blocks:
            seq.block_hashes.append(self._block_hash(seq, len(seq.block_hashes)))

    def claim_cached_prefix(self, seq: Sequence) -> int:
        """Reuse cached blocks for the start of a sequence that has none; returns tokens reused.

        At least one token is always left to compute, so the step has logits to sample from.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        num_candidates = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, num_candidates)
        for index in range(num_candidates):
            block = self.device.lookup(seq.block_hashes[index])
            if block is None:
                break
            self.device.incref(block)
            seq.block_table.append(block)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_registered_blocks = len(seq.block_table)
        self.num_prefix_hit_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    def register_computed(self, seq: Sequence) -> None:
        """Record the content of ``seq``'s blocks that became full (after a step)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq, num_full)
        for index in range(seq.num_registered_blocks, num_full):
            self.device.register(seq.block_table[index], seq.block_hashes[index])
        seq.num_registered_blocks = num_full

    # -- swapping ---------------------------------------------------------------------------
    def _distinct_blocks(self, seqs: list[Sequence]) -> list[int]:
        return list(dict.fromkeys(b for s in seqs for b in s.block_table))

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        """True if the CPU pool can hold all of these sequences' blocks."""
        return len(self._distinct_blocks(seqs)) <= self.cpu.num_free

    def swap_out(self, seqs: list[Sequence]) -> dict[int, int]:
        """Move blocks to the CPU pool (shared blocks once); returns device -> cpu."""
        mapping = {b: self.cpu.allocate() for b in self._distinct_blocks(seqs)}
        self._remap(seqs, mapping, self.device, self.cpu)
        for seq in seqs:
            seq.is_swapped = True
        return mapping

    def num_blocks_to_swap_in(self, seqs: list[Sequence]) -> int:
        """Device blocks a swap-in of these sequences takes."""
        return len(self._distinct_blocks(seqs))

    def swap_in(self, seqs: list[Sequence]) -> dict[int, int]:
        """Move blocks back to the device; returns cpu -> device."""
        mapping = {b: self.device.allocate() for b in self._distinct_blocks(seqs)}
        self._remap(seqs, mapping, self.cpu, self.device)
        for seq in seqs:
            seq.is_swapped = False
            seq.num_registered_blocks = 0
        return mapping

    @staticmethod
    def _remap(
        seqs: list[Sequence], mapping: dict[int, int], source: BlockPool, target: BlockPool
    ) -> None:
        for seq in seqs:
            for i, block in enumerate(seq.block_table):
                source.decref(block)
                seq.block_table[i] = mapping[block]
        # Each reference moved: the target blocks start at 1 from allocate(); add the rest.
        counts: dict[int, int] = {}
        for seq in seqs:
            for block in seq.block_table:
                counts[block] = counts.get(block, 0) + 1
        for block, count in counts.items():
            for _ in range(count - 1):
                target.incref(block)
