"""The decoder's element-wise steps as fused Triton kernels (GPU fast path of ``decoder_ops``).

``TritonDecoderOps`` runs, each as one kernel launch that reads its inputs once:

* ``add_rms_norm``: the pending layer output added to the float32 residual stream (in place)
  and the RMSNorm of the sum; ``rms_norm`` alone likewise;
* ``silu_and_mul``: SiLU(gate) * up of the fused gate/up output;
* ``rope_write_kv``: RoPE on q and k, the rotated k and the v of the step stored at their cache
  slots (negative slots, a CUDA graph's padding rows, skipped), and q returned.

The torch ops run each of these as 2-6 kernels with temporaries in between. The kernels compute
in float32 and round once, where torch rounds after each op, so 16-bit results differ in the
last bit now and then; ``TorchDecoderOps`` stays the reference they are tested against (in
Triton's CPU interpreter without a GPU). The model takes these ops on CUDA with Triton for
16-bit weights only: float32 models keep the torch ops, whose rounding matches transformers'
(the float32 parity tests compare greedy tokens exactly). ``refine_logits`` stays torch's.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from .decoder_ops import TorchDecoderOps
from .paged_attention import AttentionBackend, LayerCache, PagedAttention
from .rotary import RopeRows

HAS_TRITON = importlib.util.find_spec("triton") is not None
#: Elements of the intermediate dim per silu_and_mul program.
_SILU_BLOCK = 1024


def is_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when the model on ``device`` in ``dtype`` takes these ops (see the docstring)."""
    return HAS_TRITON and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernels() -> ModuleType:
    """The kernel module, imported (and its kernels decorated) on first use."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use the torch decoder ops")
    from . import triton_fused_kernels

    return triton_fused_kernels


def _row_warps(n: int) -> int:
    """Warps for a program holding one row of ``n`` elements."""
    return 8 if n >= 4096 else 4 if n >= 1024 else 1


class TritonDecoderOps(TorchDecoderOps):
    """The decoder's element-wise steps as fused Triton kernels (see the module docstring)."""

    name = "triton fused kernels"
    attention_backend: AttentionBackend = "triton"

    def _norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        t, n = x.shape
        out = torch.empty((t, n), dtype=weight.dtype, device=x.device)
        if t == 0:
            return out
        block = _next_pow2(n)
        _kernels().rms_norm_kernel[(t,)](
            x,
            x if delta is None else delta,
            weight,
            out,
            x.stride(0),
            0 if delta is None else delta.stride(0),
            out.stride(0),
            n,
            eps,
            HAS_DELTA=delta is not None,
            BLOCK=block,
            num_warps=_row_warps(block),
        )
        return out

    @staticmethod
    def _rows_ok(*tensors: torch.Tensor) -> bool:
        return all(t.dim() == 2 and t.stride(1) == 1 for t in tensors)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """See ``TorchDecoderOps.rms_norm``."""
        if not self._rows_ok(x):
            return super().rms_norm(x, weight, eps)
        return self._norm(x, None, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """See ``TorchDecoderOps.add_rms_norm`` (one pass: x read once, written once)."""
        if not self._rows_ok(x, delta):
            return super().add_rms_norm(x, delta, weight, eps)
        return self._norm(x, delta, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """See ``TorchDecoderOps.silu_and_mul``."""
        if not self._rows_ok(gate_up):
            return super().silu_and_mul(gate_up)
        t, width = gate_up.shape
        inter = width // 2
        out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
        if t == 0:
            return out
        block = min(_SILU_BLOCK, _next_pow2(inter))
        _kernels().silu_and_mul_kernel[(t, -(-inter // block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4
        )
        return out

    def rope_write_kv(
        self, qkv: torch.Tensor, rope: RopeRows, kv_cache: LayerCache, attention: PagedAttention
    ) -> torch.Tensor:
        """See ``TorchDecoderOps.rope_write_kv`` (one kernel: q/k rotated, k/v stored)."""
        cos, sin_signed = rope
        k_cache, v_cache = kv_cache
        heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        if (
            not self._rows_ok(qkv, cos, sin_signed)
            or head_dim % 2
            or cos.shape[-1] != head_dim  # partial rotary: the kernel rotates whole heads
            or k_cache.stride(2) != 1
            or k_cache.stride() != v_cache.stride()
        ):
            return super().rope_write_kv(qkv, rope, kv_cache, attention)
        t = qkv.shape[0]
        q = torch.empty((t, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        if t == 0:
            return q
        _kernels().rope_write_kv_kernel[(t,)](
            qkv,
            cos,
            sin_signed,
            q,
            k_cache,
            v_cache,
            attention.meta.slot_mapping,
            qkv.stride(0),
            cos.stride(0),
            sin_signed.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            heads,
            kv_heads,
            head_dim,
            H_PAD=_next_pow2(heads),
            KV_PAD=_next_pow2(kv_heads),
            D_PAD=_next_pow2(head_dim),
            num_warps=4,
        )
        return q
