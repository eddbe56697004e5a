"""Attention over the paged KV cache for one step, in plain torch (device-agnostic).

``PagedAttention`` is built once per forward from the step's AttentionMetadata: everything
that depends only on the metadata (gather indices, additive masks) is derived there and reused
by every layer, so a layer runs a handful of kernels per group. On CPU the cost of decode
attention is moving K/V (memory bound) and tiny batched GEMMs, so each path is chosen to
gather K/V once, in big chunks, and to give the GEMMs a usable shape:

* decode, few kv heads (<= ``BLOCK_DIAGONAL_MAX_KV_HEADS``): whole cache blocks are gathered
  (one ``index_select`` per K/V, [G, K, kv_heads * head_dim], no transpose) and the query heads
  are laid out block-diagonally ([G, heads, kv_heads * head_dim], zero outside their kv head),
  so one ``baddbmm`` computes every head's scores (+ mask, scaled) against the token-major
  keys. It does kv_heads times the useful FLOPs, which are tiny in decode; measured on the
  2-core CPU (bf16, 64 sequences, context 200) its attention is ~20% faster than the per-head
  layout below (block gathers copy 6 KB chunks; the per-head GEMMs have only heads/kv_heads
  rows, which batched GEMM kernels handle poorly).
* decode, many kv heads: per-head rows are gathered into [G * kv_heads, K, head_dim] and the
  ``rep = heads / kv_heads`` query heads sharing a kv head form the GEMM rows
  (grouped-query attention without expanding K/V). scaled_dot_product_attention, with
  ``enable_gqa`` or with K/V repeated, was several times slower for single-token queries.
* prefill chunks (Q > 1): per-head rows as above, then ``scaled_dot_product_attention`` with
  the boolean mask and ``enable_gqa`` (flash kernel: no [Q, K] scores per head in memory).

The ``triton`` backend (CUDA only, chosen by the model) sends decode-only steps, whose metadata
then carries ``DecodeTables`` instead of groups, to ``triton_paged_attention``: no gather copy,
and K/V are written by its kernel too. The ``cpu`` backend (chosen with the fused CPU decoder
ops) sends every step to the C++ kernel ``cpu_kernels.paged_decode_attention``, which likewise
reads K/V through the block tables and computes only each row's own context; prefill tokens
are rows too, each attending its own position + 1 keys (on this 2-core machine 2.6x faster
than the masked SDPA for ten 100-token prompts, 1.7x for one 1,000-token prompt). Steps the
kernels do not take keep the torch path above, which stays the reference both kernels are
tested against.

Per-layer options go to each call, the step's plans staying shared: a sliding ``window``
(Mistral, Qwen2's upper layers, Gemma), logit soft-capping and the score ``scale``. The torch
path narrows the causal masks to a window once per forward and window (``_window_plans``);
the kernels start each row at its window's first position, so they never read the blocks the
block manager freed before it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F

from . import triton_paged_attention
from .attention import AttentionGroup, AttentionMetadata

#: Up to this many kv heads, decode uses the block-diagonal query layout (see module doc).
BLOCK_DIAGONAL_MAX_KV_HEADS = 4

AttentionBackend = Literal["torch", "triton", "cpu"]
#: One layer's (K, V) cache tensors, ``[num_slots, kv_heads, head_dim]`` each.
LayerCache = tuple[torch.Tensor, torch.Tensor]


@lru_cache(maxsize=8)
def _block_diagonal_mask(
    kv_heads: int, rep: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[heads, kv_heads, 1]: 1 where query head h belongs to kv head j (broadcasts over D)."""
    kv_of_head = torch.arange(kv_heads * rep, device=device) // rep
    own = kv_of_head[:, None] == torch.arange(kv_heads, device=device)[None, :]
    return own.to(dtype).unsqueeze(-1)


@dataclass(frozen=True)
class AttentionOptions:
    """One layer's attention options (see ``PagedAttention.__call__``)."""

    #: Sliding window in tokens (None: full causal attention).
    window: int | None
    #: Logit soft-capping: scores -> softcap * tanh(scores / softcap) (None: off).
    softcap: float | None
    #: Score scale (head_dim ** -0.5 unless the model says otherwise).
    scale: float


@dataclass
class _GroupPlan:
    """Per-forward tensors of one attention group, shared by all layers."""

    num_seqs: int
    q_len: int
    k_len: int
    token_range: tuple[int, int] | None  # slice of the flat axis, when no gather is needed
    token_index: torch.Tensor  # [G*Q] rows of the flat axis to gather
    block_rows: torch.Tensor | None  # [G*K/bs] block ids (block-diagonal decode path)
    head_rows: torch.Tensor | None  # [G*kv_heads*K] rows of the cache as [slots*kv_heads, D]
    bias: torch.Tensor | None  # additive decode mask: [G, 1, K] or [G*kv_heads, rep, K]
    mask: torch.Tensor  # [G, 1, Q, K] bool (prefill)


class PagedAttention:
    """Attention of all groups of one step; call once per layer."""

    def __init__(
        self,
        meta: AttentionMetadata,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        backend: AttentionBackend = "torch",
        block_size: int = 0,
        kernels: ModuleType | None = None,
    ) -> None:
        """``block_size`` is only read by the kernel backends (they address slots);
        ``kernels``, the fused CPU extension (``cpu_kernels.load``), only by the cpu one."""
        self.meta = meta
        self.backend = backend
        #: A kernel runs this step (decode-only, triton or cpu backend); else torch.
        self.is_kernel_step = backend != "torch" and meta.decode is not None
        if self.is_kernel_step and block_size < 1:
            raise ValueError(f"the {backend} backend needs the cache's block_size")
        if backend == "cpu" and kernels is None:
            raise ValueError("the cpu attention backend needs the fused CPU kernels")
        self.kernels = kernels
        self.block_size = block_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rep = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.dtype = dtype
        #: Group plans narrowed to a sliding window, per window (``_window_plans``).
        self._windowed: dict[int, list[_GroupPlan]] = {}
        self.plans = [self._plan(group, dtype) for group in meta.groups]
        self.bd_mask: torch.Tensor | None = None
        if any(p.block_rows is not None for p in self.plans):
            device = meta.slot_mapping.device
            self.bd_mask = _block_diagonal_mask(num_kv_heads, self.rep, dtype, device)

    def _plan(self, group: AttentionGroup, dtype: torch.dtype) -> _GroupPlan:
        g, q_len = group.token_index.shape
        k_len = group.kv_slots.shape[1]
        kvh = self.num_kv_heads
        block_rows = head_rows = None
        if q_len == 1 and group.block_table is not None and kvh <= BLOCK_DIAGONAL_MAX_KV_HEADS:
            block_rows = group.block_table.reshape(-1)
        else:
            heads = torch.arange(kvh, device=group.kv_slots.device)
            head_rows = (group.kv_slots.unsqueeze(1) * kvh + heads[:, None]).reshape(-1)
        plan = _GroupPlan(
            num_seqs=g,
            q_len=q_len,
            k_len=k_len,
            token_range=group.token_range,
            token_index=group.token_index.reshape(-1),
            block_rows=block_rows,
            head_rows=head_rows,
            bias=None,
            mask=group.mask,
        )
        plan.bias = self._decode_bias(plan, dtype)
        return plan

    def _decode_bias(self, p: _GroupPlan, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask of a decode group's layout (None for prefill groups)."""
        if p.q_len != 1:
            return None
        g, k_len = p.num_seqs, p.k_len
        bias = torch.zeros((g, 1, k_len), dtype=dtype, device=p.mask.device)
        bias.masked_fill_(p.mask.view(g, 1, k_len).logical_not(), float("-inf"))
        if p.block_rows is not None:
            return bias
        kvh = self.num_kv_heads
        bias = bias.unsqueeze(1).expand(g, kvh, self.rep, k_len)
        return bias.reshape(g * kvh, self.rep, k_len)

    def _narrow_to_window(self, p: _GroupPlan, window: int) -> _GroupPlan:
        """``p`` with its mask (and decode bias) limited to the last ``window`` positions."""
        num_allowed = p.mask.sum(dim=-1, keepdim=True)  # position + 1 of each query row
        key_pos = torch.arange(p.k_len, device=p.mask.device)
        mask = p.mask & (key_pos > num_allowed - 1 - window)
        narrowed = replace(p, mask=mask)
        narrowed.bias = self._decode_bias(narrowed, self.dtype)
        return narrowed

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        """Store the step's k/v [T, kv_heads, head_dim] at their slots (before __call__)."""
        if self.is_kernel_step and self.backend == "triton":
            triton_paged_attention.write_kv_cache(k, v, k_cache, v_cache, self.meta.slot_mapping)
            return
        k_cache.index_copy_(0, self.meta.slot_mapping, k)
        v_cache.index_copy_(0, self.meta.slot_mapping, v)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q: [T, heads, head_dim] (rotated, may be strided); caches already hold this step's
        K/V. Returns [T, heads * head_dim] in flat token order.

        Per-layer options (the step's metadata stays shared): ``window``, a sliding window
        in tokens: a query at position p attends keys at positions > p - window (itself and
        the window - 1 before it, transformers' and vLLM's rule); ``softcap``: scores become
        ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2's
        attn_logit_softcapping); ``scale``: the score scale (default head_dim ** -0.5)."""
        options = AttentionOptions(window, softcap, self.scale if scale is None else scale)
        if self.is_kernel_step:
            return self._kernel(q, k_cache, v_cache, options)
        plans = self.plans if window is None else self._window_plans(window)
        outs = [self._group(p, q, k_cache, v_cache, options) for p in plans]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if self.meta.output_index is not None:
            out = out.index_select(0, self.meta.output_index)
        return out

    def _kernel(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: AttentionOptions
    ) -> torch.Tensor:
        """The step on the cpu or triton kernel (they read the block tables themselves)."""
        decode = self.meta.decode
        if self.backend == "cpu":
            out = self.kernels.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                decode.block_tables,
                decode.context_lens,
                self.block_size,
                o.scale,
                o.window or 0,
                o.softcap or 0.0,
            )
        else:
            out = triton_paged_attention.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                decode.block_tables,
                decode.context_lens,
                block_size=self.block_size,
                max_context_len=decode.max_context_len,
                scale=o.scale,
                window=o.window,
                softcap=o.softcap,
            )
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _window_plans(self, window: int) -> list[_GroupPlan]:
        """The group plans with masks narrowed to ``window``, derived once per forward and
        window from the causal masks (a query's position is its row's count of allowed keys
        minus one, since causal rows allow keys 0..position)."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if window not in self._windowed:
            self._windowed[window] = [self._narrow_to_window(p, window) for p in self.plans]
        return self._windowed[window]

    def _group(
        self,
        p: _GroupPlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        o: AttentionOptions,
    ) -> torch.Tensor:
        if p.token_range is not None:
            qg = q[p.token_range[0] : p.token_range[1]]
        else:
            qg = q.index_select(0, p.token_index)
        if p.block_rows is not None:
            return self._decode_block_diagonal(p, qg, k_cache, v_cache, o)
        g, kvh, d = p.num_seqs, self.num_kv_heads, self.head_dim
        k = k_cache.view(-1, d).index_select(0, p.head_rows)
        v = v_cache.view(-1, d).index_select(0, p.head_rows)
        if p.bias is not None:  # decode, per-head layout
            qg = qg.reshape(g * kvh, self.rep, d)
            k = k.view(g * kvh, p.k_len, d)
            probs = torch.softmax(_scores(p.bias, qg, k.transpose(1, 2), o), dim=-1)
            return torch.bmm(probs, v.view(g * kvh, p.k_len, d)).view(g, self.num_heads * d)
        qg = qg.view(g, p.q_len, self.num_heads, d).transpose(1, 2)
        k, v = k.view(g, kvh, p.k_len, d), v.view(g, kvh, p.k_len, d)
        if o.softcap is not None:
            out = _softcapped_prefill(qg, k, v, p.mask, o)
        else:
            out = F.scaled_dot_product_attention(
                qg, k, v, attn_mask=p.mask, enable_gqa=self.rep > 1, scale=o.scale
            )
        return out.transpose(1, 2).reshape(g * p.q_len, self.num_heads * d)

    def _decode_block_diagonal(
        self,
        p: _GroupPlan,
        qg: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        o: AttentionOptions,
    ) -> torch.Tensor:
        """Single-token queries against whole gathered blocks (see the module docstring)."""
        g, kvh, d = p.num_seqs, self.num_kv_heads, self.head_dim
        width = kvh * d
        block_width = p.k_len // (p.block_rows.numel() // g) * width
        k = k_cache.view(-1, block_width).index_select(0, p.block_rows).view(g, p.k_len, width)
        v = v_cache.view(-1, block_width).index_select(0, p.block_rows).view(g, p.k_len, width)
        # [G, heads, kv_heads * head_dim], zero outside each head's own kv-head slice.
        q_bd = (qg.unsqueeze(2) * self.bd_mask).view(g, self.num_heads, width)
        scores = _scores(p.bias, q_bd, k.transpose(1, 2), o)
        out = torch.bmm(torch.softmax(scores, dim=-1), v)  # [G, heads, kv_heads * head_dim]
        # Keep each head's own kv-head slice: the diagonal of (kv head of q, kv head of v).
        out = out.view(g, kvh, self.rep, kvh, d).diagonal(dim1=1, dim2=3)  # [G, rep, d, kvh]
        return out.permute(0, 3, 1, 2).reshape(g, self.num_heads * d)


def _scores(
    bias: torch.Tensor, q: torch.Tensor, k_t: torch.Tensor, o: AttentionOptions
) -> torch.Tensor:
    """Masked decode scores ``bias + cap(scale * q @ k_t)`` (cap: the optional soft-capping)."""
    if o.softcap is None:
        return torch.baddbmm(bias, q, k_t, alpha=o.scale)
    scores = torch.bmm(q, k_t).mul_(o.scale)
    return scores.div_(o.softcap).tanh_().mul_(o.softcap).add_(bias)


def _softcapped_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, o: AttentionOptions
) -> torch.Tensor:
    """Prefill attention with soft-capped scores, written out (SDPA has no soft-capping):
    q [G, heads, Q, D], k/v [G, kv_heads, K, D], mask [G, 1, Q, K] -> [G, heads, Q, D]."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(o.scale)
    scores = scores.div_(o.softcap).tanh_().mul_(o.softcap)
    scores = scores.masked_fill_(mask.logical_not(), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)
