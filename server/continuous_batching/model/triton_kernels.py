"""The @triton.jit kernels behind ``triton_paged_attention`` (see its docstring).

Imported only on first use, never at engine import: Triton decides at decoration time whether
a kernel is compiled or interpreted (``TRITON_INTERPRET=1``), so a test can still switch the
interpreter on before the first call. This module needs triton; the wrapper module does not.
"""

import triton
import triton.language as tl

from .triton_dot import dot_f32


@triton.jit
def decode_partition_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_slots, kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int
    context_lens_ptr,  # [num_seqs] int
    out_ptr,  # [num_seqs, num_heads, head_dim] (single partition)
    part_out_ptr,  # [num_seqs, num_heads, max_parts, head_dim] fp32
    part_max_ptr,  # [num_seqs, num_heads, max_parts] fp32
    part_sum_ptr,  # [num_seqs, num_heads, max_parts] fp32
    scale,
    window,  # sliding window in tokens; 0: none
    softcap,  # logit soft-capping; read only with HAS_SOFTCAP
    stride_qs,
    stride_qh,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_os,
    stride_oh,
    max_parts,
    block_size,
    head_dim,
    rep: tl.constexpr,
    REP_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    TILE: tl.constexpr,
    PARTITION: tl.constexpr,
    IS_SINGLE_PARTITION: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    # NATIVE_DOT: K/V, q and P (for P @ V, as flash attention) stay 16-bit, both products on
    # tensor cores; else everything is float32 with IEEE dots (see dot_f32).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    start = part * PARTITION
    if start < ctx:
        rows = tl.arange(0, REP_PAD)
        dims = tl.arange(0, D_PAD)
        heads = kv_head * rep + rows
        row_ok = rows < rep
        dim_ok = dims < head_dim
        q = tl.load(
            q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        q = q.to(k_cache_ptr.dtype.element_ty if NATIVE_DOT else tl.float32)
        m = tl.full([REP_PAD], float("-inf"), dtype=tl.float32)
        lse = tl.zeros([REP_PAD], dtype=tl.float32)
        acc = tl.zeros([REP_PAD, D_PAD], dtype=tl.float32)
        stop = tl.minimum(start + PARTITION, ctx)
        k_head = k_cache_ptr + kv_head * stride_ch
        v_head = v_cache_ptr + kv_head * stride_ch
        block_row = block_tables_ptr + seq * stride_bt
        for tile_start in range(_window_start(start, ctx, window), stop, TILE):
            pos = tile_start + tl.arange(0, TILE)
            pos_ok = pos < stop
            k, v = _load_kv_tile(
                k_head, v_head, block_row, pos, pos_ok, dims, dim_ok, stride_cs, block_size
            )
            scores = _soft_cap(dot_f32(q, tl.trans(k), k, NATIVE_DOT) * scale, softcap, HAS_SOFTCAP)
            scores = tl.where(pos_ok[None, :], scores, float("-inf"))
            m, lse, acc = _online_softmax_step(scores, v, m, lse, acc, NATIVE_DOT)
        out_mask = row_ok[:, None] & dim_ok[None, :]
        if IS_SINGLE_PARTITION:
            out = acc / lse[:, None]
            tl.store(
                out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=out_mask,
            )
        else:
            row = (seq * rep * tl.num_programs(1) + heads) * max_parts + part
            tl.store(part_max_ptr + row, m, mask=row_ok)
            tl.store(part_sum_ptr + row, lse, mask=row_ok)
            tl.store(part_out_ptr + row[:, None] * head_dim + dims[None, :], acc, mask=out_mask)


@triton.jit
def _window_start(start, ctx, window):
    """The first position of a partition starting at ``start`` that a sliding window keeps
    (positions >= ctx - window; window 0: all). Starting the tile loop there keeps a valid
    key in every tile; a partition wholly before the window runs no tile and leaves m =
    -inf, sum 0, which the reduce weighs as zero."""
    if window > 0:
        start = tl.maximum(start, ctx - window)
    return start


@triton.jit
def _soft_cap(scores, softcap, HAS_SOFTCAP: tl.constexpr):
    """softcap * tanh(scores / softcap) with HAS_SOFTCAP, else scores; tanh written with exp
    (the interpreter has no tanh)."""
    if HAS_SOFTCAP:
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    return scores


@triton.jit
def _load_kv_tile(
    k_head_ptr, v_head_ptr, block_row_ptr, pos, pos_ok, dims, dim_ok, stride_cs, block_size
):
    """The K and V rows of one kv head at token positions ``pos`` of one sequence, through its
    block table row (positions past ``pos_ok`` and padded dims read as zeros)."""
    block = tl.load(block_row_ptr + pos // block_size, mask=pos_ok, other=0)
    slot = block.to(tl.int64) * block_size + pos % block_size
    kv_off = slot[:, None] * stride_cs + dims[None, :]
    kv_ok = pos_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_head_ptr + kv_off, mask=kv_ok, other=0.0)
    v = tl.load(v_head_ptr + kv_off, mask=kv_ok, other=0.0)
    return k, v


@triton.jit
def _online_softmax_step(scores, v, m, lse, acc, NATIVE_DOT: tl.constexpr):
    """One tile of the online softmax: the running max ``m``, sum ``lse`` and weighted values
    ``acc`` updated with the tile's ``scores`` (masked ones at -inf) and values ``v``."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    # The first tile always holds a valid key, so m_new is finite from then on.
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    lse = lse * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot_f32(p, v, v, NATIVE_DOT)
    return m_new, lse, acc


@triton.jit
def decode_reduce_kernel(
    context_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_os,
    stride_oh,
    num_heads,
    max_parts,
    head_dim,
    PARTS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    PARTITION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + seq)
    num_parts = tl.cdiv(ctx, PARTITION)
    parts = tl.arange(0, PARTS_PAD)
    part_ok = parts < num_parts
    base = (seq * num_heads + head) * max_parts
    m = tl.load(part_max_ptr + base + parts, mask=part_ok, other=float("-inf"))
    s = tl.load(part_sum_ptr + base + parts, mask=part_ok, other=0.0)
    m_all = tl.max(m, axis=0)
    weight = tl.where(part_ok, tl.exp(m - m_all), 0.0)
    total = tl.sum(s * weight, axis=0)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < head_dim
    acc = tl.load(
        part_out_ptr + (base + parts)[:, None] * head_dim + dims[None, :],
        mask=part_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


@triton.jit
def write_kv_kernel(
    k_ptr,  # [num_tokens, kv_heads, head_dim]
    v_ptr,
    k_cache_ptr,  # [num_slots, kv_heads, head_dim]
    v_cache_ptr,
    slots_ptr,  # [num_tokens] int
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ch,
    num_kv_heads,
    head_dim,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, H_PAD)
        dims = tl.arange(0, D_PAD)
        ok = (heads < num_kv_heads)[:, None] & (dims < head_dim)[None, :]
        cache_off = slot * stride_cs + heads[:, None] * stride_ch + dims[None, :]
        k_off = token * stride_kt + heads[:, None] * stride_kh + dims[None, :]
        tl.store(k_cache_ptr + cache_off, tl.load(k_ptr + k_off, mask=ok), mask=ok)
        v_off = token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
        tl.store(v_cache_ptr + cache_off, tl.load(v_ptr + v_off, mask=ok), mask=ok)
