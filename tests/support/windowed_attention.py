"""A paged-attention step with sliding windows, soft-capping and a scale, and its exact answer
(float64, position by position from transformers' rule: a query at position p attends the
keys at positions > p - window). Shared by the torch, CPU-kernel and Triton tests.

Blocks wholly before every query's window are *poisoned* (NaN, or huge finite values where
a path legitimately reads them under a mask), so a path that reads a freed block shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Keys and values of freed blocks: NaN for the kernels (they must never read them).
POISON = float("nan")


@dataclass
class WindowedCase:
    """One step: query/context lengths per sequence, shuffled tables, caches, q."""

    query_lens: list[int]
    context_lens: list[int]
    tables: list[list[int]]  # real block ids (dead ones poisoned)
    null_tables: list[list[int]]  # the same with dead blocks as -1 (block_manager.NULL_BLOCK)
    q: torch.Tensor  # [T, heads, dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_size: int
    window: int | None

    def exact(self, softcap: float | None = None, scale: float | None = None) -> torch.Tensor:
        """[T, heads * dim] float64: each query token against its window's keys."""
        heads, dim = self.q.shape[1], self.q.shape[2]
        kv_heads = self.k_cache.shape[1]
        scale = dim**-0.5 if scale is None else scale
        rows, token = [], 0
        for s, (n, ctx) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            for pos in range(ctx - n, ctx):
                first = 0 if self.window is None else max(0, pos + 1 - self.window)
                table = self.tables[s]
                slots = [
                    table[p // self.block_size] * self.block_size + p % self.block_size
                    for p in range(first, pos + 1)
                ]
                k, v = self.k_cache[slots].double(), self.v_cache[slots].double()
                qs = self.q[token].double().view(kv_heads, heads // kv_heads, dim)
                scores = torch.einsum("grd,lgd->grl", qs, k) * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                rows.append(torch.einsum("grl,lgd->grd", scores.softmax(-1), v).reshape(-1))
                token += 1
        return torch.stack(rows)


def windowed_case(
    query_lens: list[int],
    context_lens: list[int],
    window: int | None,
    heads: int = 4,
    kv_heads: int = 2,
    dim: int = 64,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    poison: float = POISON,
    seed: int = 0,
) -> WindowedCase:
    """Random q and caches over disjoint shuffled tables; blocks that no query of their
    sequence can attend (wholly before the first query's window) hold ``poison``."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(needed) + 2
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, null_tables, start = [], [], 0
    shape = (num_blocks * block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    for n, ctx, count in zip(query_lens, context_lens, needed, strict=True):
        table = ids[start : start + count]
        start += count
        first_needed = 0 if window is None else max(0, ctx - n + 1 - window)
        num_dead = first_needed // block_size
        for block in table[:num_dead]:
            k_cache[block * block_size : (block + 1) * block_size] = poison
            v_cache[block * block_size : (block + 1) * block_size] = poison
        tables.append(table)
        null_tables.append([-1] * num_dead + table[num_dead:])
    q = torch.randn(sum(query_lens), heads, dim, generator=gen).to(dtype)
    return WindowedCase(
        query_lens, context_lens, tables, null_tables, q, k_cache, v_cache, block_size, window
    )
