"""GPTQ int4 matmul as one Triton kernel (GPU path of ``QuantLinear``): the weight stays at
4 bits in memory and is dequantised tile by tile in registers.

It reads ``QuantLinear``'s portable layout as it is: ``packed`` uint8 [K/2, N] (row k in the
low nibble, row k + K/2 in the high one), zero points and scales [groups, N] in the compute
dtype, and the group of every input row (``g_idx``: consecutive groups of 32, 128, ... or any
act-order map once the rows are sorted by ``perm``). One program computes a [BLOCK_M, BLOCK_N]
output tile over the whole K: at decode batch sizes (M <= 16..64) it streams each 4-bit code
once, a quarter of the bytes of the bf16 matmul, where today's cuda path dequantises the whole
weight into a bf16 copy every call and then reads that too.

16-bit activations on a GPU run tensor-core dots with float32 accumulation on the tile
dequantised in their dtype (the reference weight's rounding); float32, and everything in
Triton's CPU interpreter, runs IEEE float32 dots. The block sizes are reasoned defaults for
an H100 (not tuned on one yet; ``INT4_TUNING_SPACE`` is what ``bench_int4_gpu.py --sweep``
would try). The torch reference, ``torch.mm(x, QuantLinear.weight())``, is what the tests
compare with.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
#: Off switch (benchmarks compare against the dequantise-then-matmul path).
ENABLED = True


@dataclass(frozen=True)
class Int4Launch:
    """Tile sizes of one launch; ``block_k`` counts packed rows (2 input rows each)."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


GPU_LAUNCH = Int4Launch()
INT4_TUNING_SPACE: tuple[Int4Launch, ...] = tuple(
    Int4Launch(n, k, w, s)
    for n in (32, 64, 128)
    for k in (32, 64, 128)
    for w in (4, 8)
    for s in (2, 3, 4)
)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_available(device: torch.device) -> bool:
    """True when ``QuantLinear`` on ``device`` runs this kernel (CUDA with Triton)."""
    return ENABLED and HAS_TRITON and device.type == "cuda"


def _kernels() -> ModuleType:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use the dequantise-then-matmul path")
    from . import triton_int4_kernels

    return triton_int4_kernels


def _block_m(m: int) -> int:
    """Rows per program: tl.dot needs >= 16; beyond 64 rows a bigger tile reuses the codes."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    launch: Int4Launch | None = None,
    native_dot: bool | None = None,
) -> torch.Tensor:
    """``x @ W`` for x [M, K] (rows in the layer's input order) and the 4-bit W described in
    the module docstring; returns [M, N] in x's dtype."""
    m, k = x.shape
    half, n = packed.shape
    if k != 2 * half or g_idx.shape[0] != k:
        raise ValueError(f"x has {k} columns for a layer of {2 * half} input rows")
    if not (packed.is_contiguous() and zeros.is_contiguous() and scales.is_contiguous()):
        raise ValueError("the packed codes, zeros and scales must be contiguous")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    interpreting = _interpreting()
    if launch is None:
        launch = Int4Launch(32, 32, 1, 1) if interpreting or not x.is_cuda else GPU_LAUNCH
    if native_dot is None:
        native_dot = x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda and not interpreting
    block_m = _block_m(m)
    grid = (-(-m // block_m), -(-n // launch.block_n))
    _kernels().int4_matmul_kernel[grid](
        x,
        packed,
        zeros,
        scales,
        g_idx,
        out,
        m,
        n,
        half,
        x.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        NATIVE_DOT=native_dot,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out
