"""Triton kernels for decode attention straight from the paged KV cache (GPU fast path).

The cache layout is the engine's own (``kv_cache_shape``): one ``[num_slots, kv_heads,
head_dim]`` tensor per layer for K and one for V, slot = block_id * block_size + offset. The
torch path (``paged_attention.PagedAttention``) gathers K/V into a contiguous copy before its
GEMMs; at batch 256 on an H100 that gather was 69% of the GPU time. These kernels instead read
each key/value row where it lies, through the block table:

* ``paged_decode_attention``: single-token queries. One program per (sequence, kv head,
  partition of the context): it loads the ``heads / kv_heads`` query heads sharing that kv
  head (grouped-query attention reads each K/V row once) and runs an online softmax over its
  partition. Long contexts are split into partitions (split-K) so that one long sequence still
  spreads over many programs; a second kernel merges the partitions' partial results. A
  context that fits one partition is finished by the first kernel alone.
* ``write_kv_cache``: stores the step's K/V rows into their slots (``index_copy_`` of the
  torch path); a negative slot is skipped.

Everything is computed in float32 (bf16/fp16 inputs are upcast after loading, outputs cast
back), and the matmuls use IEEE float32: exact in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, where ``tl.dot`` on bf16 operands is wrong) and no tf32 rounding on a
GPU. Decode attention is memory bound, so float32 FMAs cost nothing that matters.

Triton is optional: without it this module still imports, ``is_available()`` is False and the
engine keeps the torch path.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

#: Whether triton is installed. It is imported only on the first kernel call: importing it
#: decides, once, whether its kernels (and its standard library) are compiled or interpreted
#: (``TRITON_INTERPRET=1``), and the engine imports this module long before any test can set
#: that. The CPU-only install has no triton and runs the torch path.
HAS_TRITON = importlib.util.find_spec("triton") is not None


#: Context tokens per partition (split-K). A multiple of every TOKEN_TILE used below.
PARTITION_SIZE = 512
#: Keys processed per inner iteration. tl.dot needs every dimension >= 16.
TOKEN_TILE = 16
_MIN_DOT = 16


def is_available(device: torch.device) -> bool:
    """True when these kernels can run natively on ``device`` (a CUDA device with Triton)."""
    return HAS_TRITON and device.type == "cuda"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernels() -> ModuleType:
    """The kernel module, imported (and its kernels decorated) on first use."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use the torch paged-attention path")
    from . import triton_kernels

    return triton_kernels


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    max_context_len: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence against its cached keys.

    q: [num_seqs, num_heads, head_dim] (last dim contiguous); caches: [num_slots, kv_heads,
    head_dim]; block_tables: [num_seqs, max_blocks] block ids; context_lens: [num_seqs] keys
    per sequence (>= 1, this step's key included). ``max_context_len`` bounds them: it sizes
    the partition grid, so a CUDA graph can capture it as a fixed upper bound. Returns
    [num_seqs, num_heads, head_dim] in q's dtype (written into ``out`` when given).
    """
    kernels = _kernels()
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads or q.stride(2) != 1 or k_cache.stride(2) != 1:
        raise ValueError("need heads divisible by kv_heads and a contiguous head_dim")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("K and V caches must share one layout")
    rep = num_heads // num_kv_heads
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    max_parts = -(-max(1, max_context_len) // PARTITION_SIZE)
    is_single = max_parts == 1
    d_pad = max(_MIN_DOT, _next_pow2(head_dim))
    if is_single:  # the partial buffers are never touched: pass out as a placeholder
        part_out = part_max = part_sum = out
    else:
        part_max = torch.empty(
            (num_seqs, num_heads, max_parts), dtype=torch.float32, device=q.device
        )
        part_sum = torch.empty_like(part_max)
        part_out = torch.empty(
            (num_seqs, num_heads, max_parts, head_dim), dtype=torch.float32, device=q.device
        )
    kernels.decode_partition_kernel[(num_seqs, num_kv_heads, max_parts)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_max,
        part_sum,
        head_dim**-0.5 if scale is None else scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        max_parts,
        block_size,
        head_dim,
        rep=rep,
        REP_PAD=max(_MIN_DOT, _next_pow2(rep)),
        D_PAD=d_pad,
        TILE=TOKEN_TILE,
        PARTITION=PARTITION_SIZE,
        IS_SINGLE_PARTITION=is_single,
    )
    if not is_single:
        kernels.decode_reduce_kernel[(num_seqs, num_heads)](
            context_lens,
            out,
            part_out,
            part_max,
            part_sum,
            out.stride(0),
            out.stride(1),
            num_heads,
            max_parts,
            head_dim,
            PARTS_PAD=_next_pow2(max_parts),
            D_PAD=d_pad,
            PARTITION=PARTITION_SIZE,
        )
    return out


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k/v [num_tokens, kv_heads, head_dim] (head_dim contiguous, may be strided views)
    into the caches at ``slot_mapping`` [num_tokens]; tokens with a negative slot are skipped."""
    kernels = _kernels()
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("need a contiguous head_dim and K/V caches of one layout")
    kernels.write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        num_kv_heads,
        head_dim,
        H_PAD=_next_pow2(num_kv_heads),
        D_PAD=_next_pow2(head_dim),
    )
