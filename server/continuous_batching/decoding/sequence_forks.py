"""Forking sequences and their KV blocks: a request's ``n`` samples and its beams.

A fork shares the parent's blocks (reference counts, copy-on-write in the block manager)
instead of copying them: ``n`` samples of one prompt hold the prompt's KV once, and a beam that
continues another shares everything but the block it writes next. The parent's own references
are given back once its children hold theirs, so a parent that no child continues frees its
blocks.

Plain Python over sequences and the block manager: no tensors.
"""

from __future__ import annotations

from collections.abc import Callable

from protocol.generation import FinishReason
from server.common.detokenizer import IncrementalDetokenizer
from server.continuous_batching.scheduling.block_manager import BlockManager
from server.continuous_batching.sequence import Sequence, SequenceGroup

__all__ = ["finish_all", "fork_beams", "fork_samples"]


def fork_samples(
    group: SequenceGroup,
    parent: Sequence,
    num: int,
    block_manager: BlockManager,
    new_detokenizer: Callable[[SequenceGroup], IncrementalDetokenizer],
) -> list[Sequence]:
    """Replace ``parent`` (the prompt, nothing generated yet) by ``num`` sample sequences
    sharing its blocks, choices ``0..num-1``, each with its own detokenizer; returns them."""
    children = []
    for index in range(num):
        child = parent.fork()
        block_manager.fork(parent, child)
        child.choice_index = index
        child.detokenizer = new_detokenizer(group)
        children.append(child)
    block_manager.free(parent)
    group.seqs = children
    return children


def fork_beams(
    group: SequenceGroup,
    parents: list[Sequence],
    beams: list[tuple[int, int]],
    block_manager: BlockManager,
) -> list[Sequence]:
    """Replace the running ``parents`` by the new beams, each ``(parent row, token)``: a fork of
    ``parents[row]`` with ``token`` appended. A parent continued by several beams is forked
    several times; one continued by none has its blocks freed. Returns the new beams."""
    children = []
    for parent_row, token in beams:
        parent = parents[parent_row]
        child = parent.fork()
        block_manager.fork(parent, child)
        child.token_ids.append(token)
        children.append(child)
    # The children hold their own references now: the parents' go back.
    for seq in parents:
        block_manager.free(seq)
    group.seqs = children
    return children


def finish_all(seqs: list[Sequence], reason: FinishReason, block_manager: BlockManager) -> None:
    """End every sequence of ``seqs`` with ``reason`` and free its blocks."""
    for seq in seqs:
        block_manager.free(seq)
        seq.finish_reason = reason
