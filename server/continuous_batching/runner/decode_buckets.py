"""Decode steps padded to a few batch sizes ("buckets"), the shapes CUDA graphs are captured for.

A CUDA graph replays fixed shapes, so a decode-only step of n sequences runs the graph of the
smallest bucket >= n, its inputs padded with dummy rows. A dummy row decodes token 0 at
position 0 with a context of one key in the runner's dummy block: a block the block manager
never hands out, so the row writes no real sequence's cache and reads nothing but itself; its
output row is dropped. Plain Python: the same padding runs eagerly on a CPU, where the tests
check that it changes no token.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Buckets below this are powers of two; from it on they grow by this step (at most
#: ``_BUCKET_STEP - 1`` padded rows per step, and a graph per step of batch size).
_BUCKET_STEP = 16


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_num_seqs``, which is always the last bucket."""
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be >= 1")
    buckets = [b for b in (1, 2, 4, 8) if b < _BUCKET_STEP]
    buckets += list(range(_BUCKET_STEP, max_num_seqs + 1, _BUCKET_STEP))
    buckets = [b for b in buckets if b < max_num_seqs]
    return buckets + [max_num_seqs]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` rows (``buckets`` ascending), else None."""
    for bucket in buckets:
        if bucket >= num_seqs:
            return bucket
    return None


@dataclass
class DecodeInputs:
    """One decode-only step: row i is sequence i's single new token."""

    input_ids: list[int]
    positions: list[int]
    context_lens: list[int]  # keys after this step, the new one included (= position + 1)
    block_tables: list[list[int]]

    @property
    def num_seqs(self) -> int:
        return len(self.input_ids)


def pad_decode_inputs(inputs: DecodeInputs, size: int, dummy_block: int) -> DecodeInputs:
    """``inputs`` with dummy rows appended up to ``size`` rows (see the module docstring)."""
    num_pad = size - inputs.num_seqs
    if num_pad < 0:
        raise ValueError(f"{inputs.num_seqs} rows do not fit a bucket of {size}")
    return DecodeInputs(
        input_ids=inputs.input_ids + [0] * num_pad,
        positions=inputs.positions + [0] * num_pad,
        context_lens=inputs.context_lens + [1] * num_pad,
        block_tables=inputs.block_tables + [[dummy_block]] * num_pad,
    )
