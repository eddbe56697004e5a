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

Precision: float32 caches are computed in float32 with IEEE dots (exact, no tf32 rounding:
the float32 parity tests depend on it). 16-bit caches on a GPU keep K/V in their own dtype
(``native_dot``): both products run on tensor cores with float32 accumulation and float32
softmax statistics, P rounded to the cache dtype for P @ V (as flash attention does). Upcasting
them instead made the products IEEE float32 FMAs on the CUDA cores, and ``tl.dot`` pads the
``rep`` query rows of a kv head to 16, so at rep 4 that was 4x the useful FMAs: at batch 256 on
an H100 the kernel was compute bound at about 9x the time of reading K/V once. In Triton's CPU
interpreter (``TRITON_INTERPRET=1``), whose ``tl.dot`` on bf16 operands is wrong, 16-bit inputs
take the float32 path.

Work per program (see ``launch_config``): the context partition (split-K) is sized from the
batch, so that (sequences x kv heads x partitions) gives the GPU enough programs; a batch that
has enough on its own runs one partition per sequence and no reduce kernel. The key tile and
warp count are tunables (``DecodeLaunch``; ``DECODE_TUNING_SPACE`` lists what
``benchmarks/bench_decode_attention.py --sweep`` tries on an H100). None of these choices was
measured on a GPU yet: they are reasoned, not tuned.

Triton is optional: without it this module still imports, ``is_available()`` is False and the
engine keeps the torch path.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType

import torch

#: Whether triton is installed. It is imported only on the first kernel call: importing it
#: decides, once, whether its kernels (and its standard library) are compiled or interpreted
#: (``TRITON_INTERPRET=1``), and the engine imports this module long before any test can set
#: that. The CPU-only install has no triton and runs the torch path.
HAS_TRITON = importlib.util.find_spec("triton") is not None


#: The smallest context partition (split-K) the launch picks on its own; tests force smaller.
PARTITION_SIZE = 512
#: Keys per inner iteration in the interpreter (tl.dot needs every dimension >= 16; the
#: interpreter's cost is per op, and small tiles keep its tests quick).
TOKEN_TILE = 16
_MIN_DOT = 16
#: Programs (sequences x kv heads x partitions) a decode launch aims for: about 4 per SM of an
#: H100 (132 SMs), so every SM has several programs to hide the latency of its loads.
TARGET_PROGRAMS = 528


@dataclass(frozen=True)
class DecodeLaunch:
    """The tunables of one decode-attention launch (Triton compiles one kernel per value)."""

    #: Keys loaded per inner iteration: bigger tiles put more bytes in flight per program.
    tile: int = 64
    num_warps: int = 4
    num_stages: int = 2


#: The GPU default: 64 keys x 128 dims x 2 bytes = 16 KB of K and of V per iteration.
GPU_LAUNCH = DecodeLaunch()
#: What ``bench_decode_attention.py --sweep`` tries on an H100 (documented, not autotuned at
#: run time: autotuning benchmarks on first call, which may be inside a CUDA graph capture).
DECODE_TUNING_SPACE: tuple[DecodeLaunch, ...] = tuple(
    DecodeLaunch(tile, warps, stages)
    for tile in (32, 64, 128)
    for warps in (4, 8)
    for stages in (1, 2, 3)
)


def is_available(device: torch.device) -> bool:
    """True when these kernels can run natively on ``device`` (a CUDA device with Triton)."""
    return HAS_TRITON and device.type == "cuda"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def is_interpreting() -> bool:
    """True when Triton runs its kernels in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_launch(device: torch.device) -> DecodeLaunch:
    """``GPU_LAUNCH`` on a GPU; small tiles in the interpreter (see ``TOKEN_TILE``)."""
    if device.type == "cuda" and not is_interpreting():
        return GPU_LAUNCH
    return DecodeLaunch(tile=TOKEN_TILE, num_warps=1, num_stages=1)


def choose_partition(
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int,
    tile: int,
    target_programs: int = TARGET_PROGRAMS,
) -> int:
    """Context tokens per partition: every context in one partition when the batch alone
    gives ``target_programs`` (no partial results, no reduce kernel); else split so that a
    context of ``max_context_len`` does, in partitions of at least ``max(tile,
    PARTITION_SIZE // 8)`` keys. A power of two times ``tile`` (a constexpr: few distinct
    kernels), sized from ``max_context_len``, the bound a CUDA graph captures."""
    ctx = max(1, max_context_len)
    whole = tile * _next_pow2(-(-ctx // tile))
    programs = num_seqs * num_kv_heads
    if programs >= target_programs:
        return whole
    parts = -(-target_programs // max(1, programs))
    smallest = max(tile, PARTITION_SIZE // 8)
    # Rounded down to a power of two times the tile: at least ``parts`` partitions.
    size = tile * (1 << max(0, (ctx // (parts * tile)).bit_length() - 1))
    return min(whole, max(smallest, size))


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
    partition: int | None = None,
    launch: DecodeLaunch | None = None,
    native_dot: bool | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence against its cached keys.

    q: [num_seqs, num_heads, head_dim] (last dim contiguous); caches: [num_slots, kv_heads,
    head_dim]; block_tables: [num_seqs, max_blocks] block ids; context_lens: [num_seqs] keys
    per sequence (>= 1, this step's key included). ``max_context_len`` bounds them: it sizes
    the partition grid, so a CUDA graph can capture it as a fixed upper bound. Returns
    [num_seqs, num_heads, head_dim] in q's dtype (written into ``out`` when given).

    ``partition`` (keys per split-K partition, a multiple of the tile; default
    ``choose_partition``), ``launch`` (default ``default_launch``) and ``native_dot`` (default:
    16-bit caches on a GPU, not interpreted) override the choices the module docstring
    describes; tests and the microbenchmark use them. ``window``: a sliding window, keys at
    positions >= context_len - window only; ``softcap``: scores -> softcap * tanh(scores /
    softcap) (see ``PagedAttention.__call__``).
    """
    kernels = _kernels()
    num_seqs, num_heads, head_dim = q.shape
    if num_heads % k_cache.shape[1] or q.stride(2) != 1 or k_cache.stride(2) != 1:
        raise ValueError("need heads divisible by kv_heads and a contiguous head_dim")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("K and V caches must share one layout")
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    plan = _plan_decode(q, k_cache, max_context_len, partition, launch, native_dot)
    # A single partition never touches the partial buffers: out stands in for them.
    partials = (out,) * 3 if plan.is_single else _partial_buffers(out, plan.max_parts)
    kernels.decode_partition_kernel[(num_seqs, k_cache.shape[1], plan.max_parts)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        *partials,
        head_dim**-0.5 if scale is None else scale,
        window or 0,
        softcap or 1.0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        plan.max_parts,
        block_size,
        head_dim,
        rep=plan.rep,
        REP_PAD=max(_MIN_DOT, _next_pow2(plan.rep)),
        D_PAD=plan.d_pad,
        TILE=plan.tile,
        PARTITION=plan.partition,
        IS_SINGLE_PARTITION=plan.is_single,
        NATIVE_DOT=plan.native_dot,
        HAS_SOFTCAP=softcap is not None,
        num_warps=plan.launch.num_warps,
        num_stages=plan.launch.num_stages,
    )
    if not plan.is_single:
        _reduce_partitions(kernels, context_lens, out, partials, plan)
    return out


def _reduce_partitions(
    kernels: ModuleType,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    plan: _DecodePlan,
) -> None:
    """Merge each (sequence, head)'s partial results into ``out`` (the reduce kernel)."""
    num_seqs, num_heads, head_dim = out.shape
    kernels.decode_reduce_kernel[(num_seqs, num_heads)](
        context_lens,
        out,
        *partials,
        out.stride(0),
        out.stride(1),
        num_heads,
        plan.max_parts,
        head_dim,
        PARTS_PAD=_next_pow2(plan.max_parts),
        D_PAD=plan.d_pad,
        PARTITION=plan.partition,
    )


@dataclass(frozen=True)
class _DecodePlan:
    """The choices of one decode-attention launch (see :func:`_plan_decode`)."""

    rep: int  # query heads per kv head
    tile: int
    partition: int
    max_parts: int
    d_pad: int
    native_dot: bool
    launch: DecodeLaunch

    @property
    def is_single(self) -> bool:
        """True when every context fits one partition: no partial results, no reduce."""
        return self.max_parts == 1


def _plan_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    max_context_len: int,
    partition: int | None,
    launch: DecodeLaunch | None,
    native_dot: bool | None,
) -> _DecodePlan:
    """The launch's tile, partition and precision: the caller's overrides, else the defaults
    :func:`paged_decode_attention` describes."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    launch = launch or default_launch(q.device)
    tile = max(_MIN_DOT, launch.tile)
    if partition is None:
        partition = _default_partition(num_seqs, num_kv_heads, max_context_len, tile)
    if partition % tile:
        raise ValueError(f"partition {partition} is not a multiple of the tile {tile}")
    if native_dot is None:
        native_dot = (
            k_cache.dtype in (torch.bfloat16, torch.float16)
            and k_cache.is_cuda
            and not is_interpreting()
        )
    return _DecodePlan(
        rep=num_heads // num_kv_heads,
        tile=tile,
        partition=partition,
        max_parts=-(-max(1, max_context_len) // partition),
        d_pad=max(_MIN_DOT, _next_pow2(head_dim)),
        native_dot=native_dot,
        launch=launch,
    )


def _default_partition(num_seqs: int, num_kv_heads: int, max_context_len: int, tile: int) -> int:
    """Keys per partition when the caller names none: :func:`choose_partition`'s, but in the
    interpreter at most ``PARTITION_SIZE`` over one program's worth of contexts."""
    if is_interpreting():
        # The interpreter runs programs one by one: more of them only costs. Splits of
        # PARTITION_SIZE keep the reduce kernel covered by the long-context tests.
        return min(PARTITION_SIZE, choose_partition(1, 1, max_context_len, tile, 1))
    return choose_partition(num_seqs, num_kv_heads, max_context_len, tile)


def _partial_buffers(
    out: torch.Tensor, max_parts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 partial results of ``max_parts`` partitions per (sequence, head) of ``out``:
    the weighted values ``[s, h, parts, d]``, and the running max and sum ``[s, h, parts]``."""
    num_seqs, num_heads, head_dim = out.shape
    part_max = torch.empty((num_seqs, num_heads, max_parts), dtype=torch.float32, device=out.device)
    part_sum = torch.empty_like(part_max)
    part_out = torch.empty(
        (num_seqs, num_heads, max_parts, head_dim), dtype=torch.float32, device=out.device
    )
    return part_out, part_max, part_sum


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
