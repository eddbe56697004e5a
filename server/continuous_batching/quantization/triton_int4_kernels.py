"""The @triton.jit kernel behind ``triton_int4`` (see its docstring); imported on first use."""

import triton
import triton.language as tl

from ..model.triton_dot import dot_f32


@triton.jit
def _dequant(codes, g_idx_ptr, rows, row_ok, zeros_ptr, scales_ptr, cols, col_ok, n):
    """(codes - zero[g, col]) * scale[g, col] in float32 with g = g_idx[row]."""
    groups = tl.load(g_idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    off = groups[:, None] * n + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    zero = tl.load(zeros_ptr + off, mask=ok, other=0.0).to(tl.float32)
    scale = tl.load(scales_ptr + off, mask=ok, other=0.0).to(tl.float32)
    return (codes.to(tl.float32) - zero) * scale


@triton.jit
def int4_matmul_kernel(
    x_ptr,  # [M, K] compute dtype, rows already in the layer's input order (perm)
    packed_ptr,  # [K / 2, N] uint8: row k in the low nibble, row k + K/2 in the high one
    zeros_ptr,  # [groups, N] compute dtype
    scales_ptr,  # [groups, N]
    g_idx_ptr,  # [K] int32: the group of each (sorted) input row
    out_ptr,  # [M, N]
    m,
    n,
    half,  # K / 2
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    # NATIVE_DOT: the dequantised tile is rounded to x's dtype, exactly as the reference
    # weight is ((q - zero) is exact, the multiply rounds once); see dot_f32.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rows_m < m
    col_ok = cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, half, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < half
        packed = tl.load(
            packed_ptr + ks[:, None].to(tl.int64) * n + cols[None, :],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0,
        )
        w_lo = _dequant(packed & 15, g_idx_ptr, ks, k_ok, zeros_ptr, scales_ptr, cols, col_ok, n)
        w_hi = _dequant(
            packed >> 4, g_idx_ptr, ks + half, k_ok, zeros_ptr, scales_ptr, cols, col_ok, n
        )
        x_off = rows_m[:, None].to(tl.int64) * stride_xm + ks[None, :]
        x_ok = m_ok[:, None] & k_ok[None, :]
        x_lo = tl.load(x_ptr + x_off, mask=x_ok, other=0.0)
        x_hi = tl.load(x_ptr + x_off + half, mask=x_ok, other=0.0)
        acc += dot_f32(x_lo, w_lo, x_lo, NATIVE_DOT)
        acc += dot_f32(x_hi, w_hi, x_hi, NATIVE_DOT)
    out_off = rows_m[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(
        out_ptr + out_off,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & col_ok[None, :],
    )
