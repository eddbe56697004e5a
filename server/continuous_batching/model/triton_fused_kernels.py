"""The @triton.jit kernels behind ``triton_fused`` (see its docstring).

Imported only on first use, like ``triton_kernels``: Triton decides at decoration time whether
a kernel is compiled or interpreted (``TRITON_INTERPRET=1``).
"""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [T, N] residual stream (float32 for a 16-bit model); updated when HAS_DELTA
    delta_ptr,  # [T, N] a layer's output, added to x first (HAS_DELTA)
    weight_ptr,  # [N]
    out_ptr,  # [T, N] in the weight's dtype
    stride_x,
    stride_delta,
    stride_out,
    n,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=ok, other=0.0)
        x = x + delta.to(tl.float32)
        tl.store(x_ptr + row * stride_x + cols, x.to(x_ptr.dtype.element_ty), mask=ok)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = x * inv_rms * weight
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2I]: gate then up
    out_ptr,  # [T, I]
    stride_in,
    stride_out,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=ok, other=0.0)
    out = gate * tl.sigmoid(gate) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate(base, heads, num_heads, dims, partner, head_dim, cos, sin):
    """Rows ``heads`` of ``[heads, head_dim]`` at ``base`` rotated: x * cos + swap(x) * sin."""
    ok = (heads < num_heads)[:, None] & (dims < head_dim)[None, :]
    x = tl.load(base + heads[:, None] * head_dim + dims[None, :], mask=ok, other=0.0)
    swapped = tl.load(base + heads[:, None] * head_dim + partner[None, :], mask=ok, other=0.0)
    return x.to(tl.float32) * cos[None, :] + swapped.to(tl.float32) * sin[None, :], ok


@triton.jit
def rope_write_kv_kernel(
    qkv_ptr,  # [T, (H + 2 KVH) * D]
    cos_ptr,  # [T, D]
    sin_ptr,  # [T, D], first half negated (RotaryTables.sin_signed)
    q_out_ptr,  # [T, H, D] contiguous
    k_cache_ptr,  # [num_slots, KVH, D]
    v_cache_ptr,
    slots_ptr,  # [T] int; a negative slot is not written
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_cs,
    stride_ch,
    num_heads,
    num_kv_heads,
    head_dim,
    H_PAD: tl.constexpr,
    KV_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, D_PAD)
    half = head_dim // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    dim_ok = dims < head_dim
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=dim_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=dim_ok, other=0.0).to(tl.float32)
    base = qkv_ptr + token * stride_qkv
    heads = tl.arange(0, H_PAD)
    q, q_ok = _rotate(base, heads, num_heads, dims, partner, head_dim, cos, sin)
    q_off = token * num_heads * head_dim + heads[:, None] * head_dim + dims[None, :]
    tl.store(q_out_ptr + q_off, q.to(q_out_ptr.dtype.element_ty), mask=q_ok)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        kv_heads = tl.arange(0, KV_PAD)
        k_base = base + num_heads * head_dim
        k, kv_ok = _rotate(k_base, kv_heads, num_kv_heads, dims, partner, head_dim, cos, sin)
        cache_off = slot * stride_cs + kv_heads[:, None] * stride_ch + dims[None, :]
        tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
        v_off = (num_heads + num_kv_heads) * head_dim + kv_heads[:, None] * head_dim + dims[None, :]
        v = tl.load(base + v_off, mask=kv_ok, other=0.0)
        tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=kv_ok)
