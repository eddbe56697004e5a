"""The decoder's element-wise steps, as torch ops (the reference) or as fused CPU kernels.

A layer asks its ``DecoderOps`` for RMSNorm (alone, or after adding a layer's output to the
residual stream), SiLU-and-multiply (GELU-tanh-and-multiply for Gemma) and "rotate q/k and
write the step's K/V to the cache"; the model asks them to turn 16-bit logits into refined
float32 ones. ``TorchDecoderOps`` runs them
as plain torch ops on any device: it is the reference the fused kernels are tested against.
``FusedCpuDecoderOps`` runs each as one pass of the C++ extension in ``cpu_kernels`` (float32
inside, one rounding), which on a CPU saves several small ops and temporaries per layer.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from . import cpu_isa, cpu_kernels
from .cpu_isa import CpuPath
from .paged_attention import AttentionBackend, LayerCache, PagedAttention
from .rotary import RopeRows, apply_partial_rope


class TorchDecoderOps:
    """Plain torch: the reference, and the path on CUDA or without the extension."""

    name = "torch"
    #: The PagedAttention backend for decode-only steps that goes with these ops.
    attention_backend: AttentionBackend = "torch"
    #: The C++ extension behind the ops (its bf16 matmul also runs the model's linears).
    module: ModuleType | None = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the residual stream x [T, N], returned in the weight's dtype."""
        if x.dtype == weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        # float32 residual stream of a 16-bit model: normalise in float32 (as HF does).
        return F.rms_norm(x, (x.shape[-1],), weight.float(), eps).to(weight.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``x += delta`` in place (x: the float32 residual stream of a 16-bit model, delta:
        a layer's output), then ``rms_norm(x)``."""
        return self.rms_norm(x.add_(delta), weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of the fused gate/up output [T, 2I] -> [T, I]."""
        inter = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GELU(gate, tanh approximation) * up of the fused gate/up output [T, 2I] -> [T, I]
        (Gemma's GeGLU)."""
        inter = gate_up.shape[-1] // 2
        return F.gelu(gate_up[:, :inter], approximate="tanh").mul_(gate_up[:, inter:])

    def refine_logits(
        self, logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int
    ) -> torch.Tensor:
        """float32 copy of the 16-bit lm_head output ``logits`` [n, V] in which each row's
        ``k`` best candidates are recomputed exactly from the float32 ``hidden`` [n, H] and
        the lm_head ``weight`` [V, H]."""
        out = logits.float()
        top = out.topk(min(k, out.shape[1]), dim=-1).indices  # [n, k]
        rows = weight.index_select(0, top.flatten()).view(*top.shape, -1).float()
        exact = torch.bmm(rows, hidden.float().unsqueeze(-1)).squeeze(-1)
        return out.scatter_(1, top, exact)

    def rope_write_kv(
        self, qkv: torch.Tensor, rope: RopeRows, kv_cache: LayerCache, attention: PagedAttention
    ) -> torch.Tensor:
        """Rotate q and k of the fused qkv [T, (H + 2 KVH) * D] by the step's ``rope`` rows,
        store the rotated k and v at the step's cache slots and return q [T, H, D] rotated."""
        cos, sin_signed = rope
        k_cache, v_cache = kv_cache
        t = qkv.shape[0]
        num_heads, kv_heads, head_dim = (
            attention.num_heads,
            attention.num_kv_heads,
            attention.head_dim,
        )
        qk_heads = num_heads + kv_heads
        # q and k are rotated together: one set of RoPE kernels for both.
        qk = apply_partial_rope(
            qkv[:, : qk_heads * head_dim].view(t, qk_heads, head_dim),
            cos.unsqueeze(1),
            sin_signed.unsqueeze(1),
        )
        v = qkv[:, qk_heads * head_dim :].view(t, kv_heads, head_dim)
        attention.write_kv(qk[:, num_heads:], v, k_cache, v_cache)
        return qk[:, :num_heads]


class FusedCpuDecoderOps(TorchDecoderOps):
    """The same steps as single passes of the C++ extension (CPU tensors only)."""

    attention_backend: AttentionBackend = "cpu"

    def __init__(self, module: ModuleType, isa: str = "") -> None:
        self.module = module
        self.name = f"fused CPU kernels ({isa})" if isa else "fused CPU kernels"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """See ``TorchDecoderOps.rms_norm``."""
        return self.module.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """See ``TorchDecoderOps.add_rms_norm`` (one pass over x)."""
        return self.module.add_rms_norm(x, delta, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """See ``TorchDecoderOps.silu_and_mul``."""
        return self.module.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """See ``TorchDecoderOps.gelu_tanh_and_mul``."""
        return self.module.gelu_tanh_and_mul(gate_up)

    def refine_logits(
        self, logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int
    ) -> torch.Tensor:
        """See ``TorchDecoderOps.refine_logits`` (one pass per row: widen, keep the top k)."""
        return self.module.refine_logits(logits, hidden.float(), weight, k)

    def rope_write_kv(
        self, qkv: torch.Tensor, rope: RopeRows, kv_cache: LayerCache, attention: PagedAttention
    ) -> torch.Tensor:
        """See ``TorchDecoderOps.rope_write_kv``. The kernel rotates whole heads; a partial
        rotary model (rope rows narrower than a head) takes the torch reference here."""
        if rope[0].shape[-1] != attention.head_dim:
            return super().rope_write_kv(qkv, rope, kv_cache, attention)
        slots = attention.meta.slot_mapping
        return self.module.rope_write_kv(qkv, *rope, *kv_cache, slots, attention.num_heads)


def decoder_ops_for(
    device: torch.device, use_cpu_kernels: bool, cpu_path: CpuPath | None = None
) -> TorchDecoderOps:
    """Fused kernels of the ``cpu_path`` level (default: the CPU's best) on a CPU when asked
    for and buildable; else the torch reference (always so at the generic level)."""
    if device.type == "cpu" and use_cpu_kernels:
        level = (cpu_path or cpu_isa.resolve()).level
        module = cpu_kernels.load(level)
        if module is not None:
            return FusedCpuDecoderOps(module, level)
    return TorchDecoderOps()
