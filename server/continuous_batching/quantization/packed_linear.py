"""Linears whose weight stays in the packed quantised layout (``packed_gguf``): the decoder's
``LinearLike`` for GGUF checkpoints kept quantised on a CPU.

``PackedLinear`` runs the fused CPU kernel (``quant_linear`` of ``cpu_kernels``: the weight is
dequantised group by group in registers inside the matmul) when a kernels module is given;
without one it dequantises the whole weight and calls ``F.linear`` on every call: the plain
reference path, slow, which the kernel tests compare with. ``ConcatLinear`` stands for a fused
matmul (q/k/v, gate/up) whose parts could not be stacked into one packed weight (different
source types, e.g. Q4_K q/k with a Q6_K v in Q4_K_M files).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from .packed_gguf import PackedWeight


def kernels_can_pack(kernels: ModuleType | None) -> bool:
    """True when ``kernels`` (a loaded ``cpu_kernels`` module, or None) has the packed matmul."""
    return kernels is not None and hasattr(kernels, "quant_linear")


class PackedLinear:
    """``x @ W.T + bias`` with W a ``PackedWeight``; output in x's dtype (float32 or bf16),
    computed in float32 and rounded once."""

    def __init__(
        self, weight: PackedWeight, bias: torch.Tensor | None, kernels: ModuleType | None
    ) -> None:
        self.weight = weight
        # The kernel adds a float32 bias: converted once here.
        self.bias = None if bias is None else bias.float().contiguous()
        self.kernels = kernels if kernels_can_pack(kernels) else None
        self.num_out = weight.num_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.kernels is None or x.dtype not in (torch.float32, torch.bfloat16):
            return self.reference(x)
        return self.kernels.quant_linear(
            x,
            w.codes,
            w.bits,
            w.group,
            w.group_scale,
            w.group_offset,
            w.super_scale,
            w.super_offset,
            self.bias,
        )

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The plain path: dequantise the whole weight (float32) and multiply."""
        return F.linear(x.float(), self.weight.dequantize(), self.bias).to(x.dtype)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``."""
        return residual + self(x)


class ConcatLinear:
    """Several linears over the same input, their outputs concatenated (in order)."""

    def __init__(self, parts: list[PackedLinear]) -> None:
        self.parts = parts
        self.num_out = sum(p.num_out for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``."""
        return residual + self(x)
