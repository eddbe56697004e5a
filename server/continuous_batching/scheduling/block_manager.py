"""Paged KV-cache bookkeeping: block pools with reference counts, copy-on-write, swapping
and prefix caching. Plain Python; the model runner does the actual copies it is told to.

Prefix caching keys a full block by a blake2b-256 digest of (its parent block's key, its token
ids), so a key names the whole prefix up to the block. A hit also compares the cached block's
parent key and token ids with the request's: a colliding key is a miss, never another prompt's
KV.

Sliding-window models (every layer attends only its last ``sliding_window`` positions) free
the blocks that fall wholly before the window after each step, so a long sequence holds at
most about ``window / block_size + 1`` blocks (vLLM's sliding-window manager does the same).
A freed entry stays in the block table as ``NULL_BLOCK``: positions keep their table index,
and the attention kernels never read it (the window excludes those positions; the torch
path reads block 0 there and masks it out). A freed block that was registered in the prefix
cache keeps its content (it becomes evictable like any other cached block), so the cache
stays consistent: a later request that claims it gets exactly the K/V its key names.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from functools import cached_property

from server.continuous_batching.sequence import Sequence

#: The parent key of a sequence's first block.
ROOT_KEY = b""
#: Block-table entry of a block freed because it fell out of the sliding window.
NULL_BLOCK = -1


def content_key(parent_key: bytes, token_ids: tuple[int, ...]) -> bytes:
    """The prefix-cache key of a block: a digest of its parent's key and its token ids."""
    packed = array("q", token_ids).tobytes()  # fixed-width ids: no two id lists pack alike
    return hashlib.blake2b(parent_key + packed, digest_size=32).digest()


@dataclass(frozen=True)
class BlockContent:
    """What a full block holds: its token ids after the prefix that ``parent_key`` names."""

    parent_key: bytes
    token_ids: tuple[int, ...]

    @cached_property
    def key(self) -> bytes:
        """The prefix-cache key (computed once)."""
        return content_key(self.parent_key, self.token_ids)


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
        # Registered blocks: content kept whole so that a hit can be checked, not just keyed.
        self._content_of_block: dict[int, BlockContent] = {}
        self._block_of_key: dict[bytes, int] = {}
        self.num_key_collisions = 0  # lookups whose key matched another content (tests)

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
            del self._block_of_key[self._content_of_block.pop(block).key]
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
            if block in self._content_of_block:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def lookup(self, content: BlockContent) -> int | None:
        """The cached block holding exactly ``content`` (same parent key and token ids), if any."""
        block = self._block_of_key.get(content.key)
        if block is None:
            return None
        if self._content_of_block[block] != content:
            self.num_key_collisions += 1
            return None  # same key, other content: reusing it would give another prompt's KV
        return block

    def register(self, block: int, content: BlockContent) -> None:
        """Remember that ``block`` (full, never written again) holds ``content``."""
        if content.key in self._block_of_key or block in self._content_of_block:
            return  # the same key already has a block, or this block has its content
        self._block_of_key[content.key] = block
        self._content_of_block[block] = content

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
        sliding_window: int | None = None,
    ) -> None:
        """``sliding_window``: the model's attention window in tokens when every layer has
        it (blocks before the window are then freed after each step); None: keep all."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
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

    def max_blocks_held(self, num_step_tokens: int) -> int | None:
        """With a sliding window, the most blocks one sequence holds while a step computes
        ``num_step_tokens`` of its tokens: the window's positions before them plus theirs,
        one more for a span that starts mid-block and one for a copy on write. None without
        a window (a sequence holds all its blocks)."""
        if self.sliding_window is None:
            return None
        return self.num_blocks_for(self.sliding_window - 1 + num_step_tokens) + 2

    def release_out_of_window(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks that its next query (at position ``num_computed_tokens``)
        cannot attend: those wholly before the window (their table entries become
        ``NULL_BLOCK``). Freed entries always form a prefix of the table, so the walk back
        from the last dead block stops at the first one freed earlier."""
        if self.sliding_window is None or seq.is_swapped:
            return
        first_needed = seq.num_computed_tokens - self.sliding_window + 1
        index = min(first_needed // self.block_size, len(seq.block_table)) - 1
        while index >= 0 and seq.block_table[index] != NULL_BLOCK:
            self.device.decref(seq.block_table[index])
            seq.block_table[index] = NULL_BLOCK
            index -= 1

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
            if block != NULL_BLOCK:
                self.device.incref(block)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (device or CPU, wherever they are)."""
        pool = self.cpu if seq.is_swapped else self.device
        for block in seq.block_table:
            if block != NULL_BLOCK:
                pool.decref(block)
        seq.block_table = []
        seq.num_registered_blocks = 0

    # -- prefix caching ---------------------------------------------------------------------
    def _block_content(self, seq: Sequence, index: int) -> BlockContent:
        start = index * self.block_size
        parent = seq.block_keys[index - 1] if index else ROOT_KEY
        return BlockContent(parent, tuple(seq.token_ids[start : start + self.block_size]))

    def _block_contents(self, seq: Sequence, start: int, stop: int) -> list[BlockContent]:
        """Contents of full blocks ``start..stop-1``, recording their keys in ``seq``."""
        contents = []
        for index in range(start, stop):
            content = self._block_content(seq, index)
            if index == len(seq.block_keys):
                seq.block_keys.append(content.key)
            contents.append(content)
        return contents

    def claim_cached_prefix(self, seq: Sequence) -> int:
        """Reuse cached blocks for the start of a sequence that has none; returns tokens reused.

        At least one token is always left to compute, so the step has logits to sample from.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        num_candidates = (seq.num_tokens - 1) // self.block_size
        for content in self._block_contents(seq, 0, num_candidates):
            block = self.device.lookup(content)
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
        start = seq.num_registered_blocks
        for index, content in enumerate(self._block_contents(seq, start, num_full), start):
            if seq.block_table[index] != NULL_BLOCK:  # freed out of the window: nothing kept
                self.device.register(seq.block_table[index], content)
        seq.num_registered_blocks = num_full

    # -- swapping ---------------------------------------------------------------------------
    def _distinct_blocks(self, seqs: list[Sequence]) -> list[int]:
        return list(dict.fromkeys(b for s in seqs for b in s.block_table if b != NULL_BLOCK))

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
                if block != NULL_BLOCK:
                    source.decref(block)
                    seq.block_table[i] = mapping[block]
        # Each reference moved: the target blocks start at 1 from allocate(); add the rest.
        counts: dict[int, int] = {}
        for seq in seqs:
            for block in seq.block_table:
                if block != NULL_BLOCK:
                    counts[block] = counts.get(block, 0) + 1
        for block, count in counts.items():
            for _ in range(count - 1):
                target.incref(block)
