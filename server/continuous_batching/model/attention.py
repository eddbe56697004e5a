"""Attention metadata for one engine step: where new K/V go and which keys each query reads.

All tokens of a step (prefill chunks and decodes alike) are flattened into one axis. Attention
is computed per *group*: sequences padded to a common query length Q and key length K so that
one batched kernel serves the whole group. Keys are always read back from the paged cache
through ``kv_slots`` (slot = block_id * block_size + offset), which is what makes a prompt
split into chunks over several steps behave exactly like one long prefill.

Everything here is planned with numpy on the host, once per step (:func:`plan_attention`), then
turned into tensors by the runner in one upload: the forward pass never loops over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: A group is split when its padded attention area (G * Q * K query/key pairs) exceeds
#: ``_WASTE_RATIO`` times the useful area plus ``_WASTE_SLACK`` pairs. Padded pairs cost real
#: work (SDPA FLOPs for padded queries, cache gathers for padded keys) while one more group
#: costs only a few small kernels per layer, so splitting starts at modest waste.
_WASTE_RATIO = 1.25
_WASTE_SLACK = 2048


@dataclass
class AttentionGroup:
    """Sequences whose attention is computed in one batched call (padded to Q and K)."""

    token_index: torch.Tensor  # [G, Q] long: rows of the flat token axis (padding -> a real row)
    query_valid: torch.Tensor  # [G, Q] bool: True for real query tokens
    kv_slots: torch.Tensor  # [G, K] long: cache slot of each key position (padding -> 0)
    mask: torch.Tensor  # [G, 1, Q, K] bool: True = may attend; every row has a True
    #: (start, stop) when token_index is exactly the flat rows start..stop-1 in order (no
    #: padding): the forward then slices instead of gathering.
    token_range: tuple[int, int] | None = None
    #: [G, K / block_size] long: block ids covering the key positions (K is a whole number of
    #: blocks, padding -> block 0), so whole blocks can be gathered at once. None: use kv_slots.
    block_table: torch.Tensor | None = None


@dataclass
class DecodeTables:
    """A step as the paged-attention kernels read it, one row per query token: token i attends
    the first ``context_lens[i]`` positions of ``block_tables[i]`` (its sequence's table; its
    own position + 1 keys, so causality is in the lengths). In a decode-only step row i is
    sequence i's one query; prefill tokens (CPU kernel only) each get a row of their own."""

    block_tables: torch.Tensor  # [num_tokens, max_blocks] int32 (padding -> block 0)
    context_lens: torch.Tensor  # [num_tokens] int32
    #: Bound on context_lens (sizes the kernel's grid; fixed in a CUDA graph).
    max_context_len: int


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot where each token's K/V is written
    groups: list[AttentionGroup]  # every real query token appears in exactly one group
    #: [num_tokens] long: row of each token in the concatenation of the groups' flattened
    #: [G*Q] outputs; None when that concatenation already is the flat token order.
    output_index: torch.Tensor | None = None
    num_tokens: int = 0
    #: Set for decode-only steps when asked (the Triton kernel's inputs); else None.
    decode: DecodeTables | None = None


def _split_groups(seq_ids: np.ndarray, q: np.ndarray, ctx: np.ndarray) -> list[np.ndarray]:
    """Greedily pack sequences (largest query, then context, first) into groups whose padding
    waste stays bounded; each group's ids are returned in flat-axis order."""
    order = seq_ids[np.lexsort((-ctx[seq_ids], -q[seq_ids]))]
    groups: list[list[int]] = []
    current: list[int] = []
    max_q = max_k = real = 0
    for i in order.tolist():
        new_q, new_k = max(max_q, int(q[i])), max(max_k, int(ctx[i]))
        new_real = real + int(q[i]) * int(ctx[i])
        padded = (len(current) + 1) * new_q * new_k
        if current and padded > _WASTE_RATIO * new_real + _WASTE_SLACK:
            groups.append(current)
            current, new_q, new_k, new_real = [], int(q[i]), int(ctx[i]), int(q[i]) * int(ctx[i])
        current.append(i)
        max_q, max_k, real = new_q, new_k, new_real
    if current:
        groups.append(current)
    return [np.sort(np.asarray(g, dtype=np.int64)) for g in groups]


@dataclass
class _HostGroup:
    """An :class:`AttentionGroup` as numpy arrays, before the step's upload."""

    token_index: np.ndarray
    query_valid: np.ndarray
    kv_slots: np.ndarray
    mask: np.ndarray
    block_table: np.ndarray
    token_range: tuple[int, int] | None


@dataclass
class AttentionPlan:
    """A step's attention metadata on the host: numpy arrays, uploaded together by the runner
    (:meth:`arrays` gives them in a fixed order, :meth:`to_metadata` takes the tensors back)."""

    num_tokens: int
    slot_mapping: np.ndarray
    groups: list[_HostGroup]
    output_index: np.ndarray | None = None
    decode_block_tables: np.ndarray | None = None
    decode_context_lens: np.ndarray | None = None
    max_context_len: int = 0

    def arrays(self) -> list[np.ndarray]:
        """Every array of the plan, in the order :meth:`to_metadata` reads them back."""
        arrays = [self.slot_mapping]
        if self.output_index is not None:
            arrays.append(self.output_index)
        if self.decode_block_tables is not None and self.decode_context_lens is not None:
            arrays += [self.decode_block_tables, self.decode_context_lens]
        for g in self.groups:
            arrays += [g.token_index, g.query_valid, g.kv_slots, g.mask, g.block_table]
        return arrays

    def to_metadata(self, tensors: list[torch.Tensor]) -> AttentionMetadata:
        """The metadata over ``tensors``: the device copies of :meth:`arrays`, same order."""
        it = iter(tensors)
        slot_mapping = next(it)
        output_index = next(it) if self.output_index is not None else None
        decode = None
        if self.decode_block_tables is not None:
            decode = DecodeTables(next(it), next(it), self.max_context_len)
        groups = [
            AttentionGroup(
                token_index=next(it),
                query_valid=next(it),
                kv_slots=next(it),
                mask=next(it),
                block_table=next(it),
                token_range=g.token_range,
            )
            for g in self.groups
        ]
        return AttentionMetadata(slot_mapping, groups, output_index, self.num_tokens, decode)


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    with_decode_tables: bool = False,
    kernel_takes_prefill: bool = False,
) -> AttentionMetadata:
    """:func:`plan_attention` with each array copied to ``device`` on its own (tests, tools;
    the runner uploads a step's arrays in one copy)."""
    plan = plan_attention(
        query_lens, context_lens, block_tables, block_size, with_decode_tables, kernel_takes_prefill
    )
    return plan.to_metadata([torch.from_numpy(a).to(device) for a in plan.arrays()])


def plan_attention(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    with_decode_tables: bool = False,
    kernel_takes_prefill: bool = False,
) -> AttentionPlan:
    """Plan the step's attention metadata (numpy; see :class:`AttentionPlan`).

    Sequence i owns ``query_lens[i]`` consecutive rows of the flat token axis (sequences in
    order) at positions ``context_lens[i] - query_lens[i] .. context_lens[i] - 1``;
    ``context_lens[i]`` counts the tokens cached after this step, new ones included, and
    ``block_tables[i]`` lists its block ids. Decodes (query_len 1) and prefill chunks are
    grouped separately; a group is split when padding would waste much (see _split_groups).
    With ``with_decode_tables``, a decode-only step (every query_len 1) gets ``DecodeTables``
    and no groups: the paged-attention kernel path; with ``kernel_takes_prefill`` too, every
    step does (one row per query token: the CPU kernel runs prefill tokens as decode rows).
    """
    n = len(query_lens)
    if not (n == len(context_lens) == len(block_tables)) or n == 0:
        raise ValueError("query_lens, context_lens and block_tables must be non-empty, same length")
    q = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    table = _block_table_array(block_tables, q, ctx, block_size)

    num_tokens = int(q.sum())
    starts = np.cumsum(q) - q
    seq_of_token = np.repeat(np.arange(n), q)
    pos = np.arange(num_tokens) - starts[seq_of_token] + (ctx - q)[seq_of_token]
    slot_mapping = table[seq_of_token, pos // block_size] * block_size + pos % block_size

    is_decode_only = num_tokens == n
    if with_decode_tables and (is_decode_only or kernel_takes_prefill):
        # The kernel reads the block tables itself: no groups, gathers or masks to build.
        token_table = table if is_decode_only else table[seq_of_token]
        return AttentionPlan(
            num_tokens=num_tokens,
            slot_mapping=slot_mapping,
            groups=[],
            decode_block_tables=token_table.astype(np.int32),
            decode_context_lens=(pos + 1).astype(np.int32),
            max_context_len=int(ctx.max()),
        )

    ids = np.arange(n)
    decode_ids, prefill_ids = ids[q == 1], ids[q > 1]
    group_ids = []
    if decode_ids.size:
        group_ids += _split_groups(decode_ids, q, ctx)
    if prefill_ids.size:
        group_ids += _split_groups(prefill_ids, q, ctx)

    groups: list[_HostGroup] = []
    output_index = np.empty(num_tokens, dtype=np.int64)
    base = 0
    for s in group_ids:
        group = _plan_group(
            q[s][:, None], ctx[s][:, None], starts[s][:, None], table[s], block_size
        )
        valid = group.query_valid
        output_index[group.token_index[valid]] = base + np.flatnonzero(valid.ravel())
        base += group.token_index.size
        groups.append(group)
    identity = base == num_tokens and np.array_equal(output_index, np.arange(num_tokens))
    return AttentionPlan(
        num_tokens=num_tokens,
        slot_mapping=slot_mapping,
        groups=groups,
        output_index=None if identity else output_index,
    )


def _block_table_array(
    block_tables: list[list[int]], q: np.ndarray, ctx: np.ndarray, block_size: int
) -> np.ndarray:
    """``[n, max blocks]`` int64 of the block tables, zero-padded, after checking that every
    sequence's query fits its context and its context its blocks."""
    n_blocks = np.fromiter((len(b) for b in block_tables), dtype=np.int64, count=len(q))
    if (q < 1).any() or (ctx < q).any() or (ctx > n_blocks * block_size).any():
        raise ValueError("need 1 <= query_len <= context_len <= len(block_table) * block_size")
    table = np.zeros((len(q), int(n_blocks.max())), dtype=np.int64)
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = blocks
    # Blocks freed out of a sliding window (block_manager.NULL_BLOCK, -1) read as block 0:
    # only the torch path reads them, under its window mask.
    return np.maximum(table, 0, out=table)


def _plan_group(
    gq: np.ndarray, gctx: np.ndarray, gstart: np.ndarray, table: np.ndarray, block_size: int
) -> _HostGroup:
    """One group's padded gathers and causal mask, from its sequences' ``[g, 1]`` query
    lengths, context lengths and first flat rows, and their block tables."""
    big_q = int(gq.max())
    # Keys are padded to whole blocks so the forward may gather whole blocks at once.
    num_key_blocks = -(-int(gctx.max()) // block_size)
    big_k = num_key_blocks * block_size
    col = np.arange(big_q)[None, :]
    valid = col < gq
    last = np.minimum(col, gq - 1)  # padded query rows repeat the last real one
    token_index = gstart + last
    query_pos = gctx - gq + last
    key_pos = np.arange(big_k)
    kv_slots = table[:, key_pos // block_size] * block_size + key_pos % block_size
    kv_slots = np.where(key_pos[None, :] < gctx, kv_slots, 0)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    flat = token_index.ravel()
    token_range = None
    if valid.all() and np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)):
        token_range = (int(flat[0]), int(flat[0]) + int(flat.size))
    return _HostGroup(
        token_index=token_index,
        query_valid=valid,
        kv_slots=kv_slots,
        mask=mask[:, None],
        block_table=np.ascontiguousarray(table[:, :num_key_blocks]),
        token_range=token_range,
    )
