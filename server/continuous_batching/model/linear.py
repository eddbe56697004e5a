"""Matrix products of the decoder, with weights packed once at load on a CPU.

On CPU, ``F.linear`` reorders (packs) the weight matrix into the kernel's blocked layout on
every call; packing once at load time makes the step's matmuls markedly faster. Who packs
(:func:`choose_packing`):

* ``kernels``: bfloat16 weights, with the fused CPU kernels loaded: the extension's own matmul
  (``bf16_linear``; AVX512-BF16 dot products, or bf16 widened to float32 in registers on
  AVX-512 and AVX2), faster than oneDNN for decode-sized batches and as fast for prefill;
* ``onednn``: float32 weights, and bfloat16 ones where oneDNN can run bf16 (``CpuPath.
  can_pack_onednn_bf16``: it raises on an AVX2-only CPU) and no kernels are loaded (about
  1.2x in bfloat16 and 2.5x in float32 for this model's shapes on the 2-core AVX-512 machine);
* ``none``: plain ``F.linear`` (CUDA, a torch without oneDNN, or no packing that runs here).
"""

from __future__ import annotations

from types import ModuleType
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from .cpu_isa import CpuPath

# A typical decode batch: oneDNN picks its blocking for this M but accepts any M.
_PACK_BATCH_HINT = 32

Packing = Literal["none", "onednn", "kernels"]


def _onednn_has_prepack() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def choose_packing(
    device: torch.device, dtype: torch.dtype, cpu_path: CpuPath, kernels: ModuleType | None
) -> Packing:
    """How the model's dense weights are packed at load (see the module docstring)."""
    if device.type != "cpu":
        return "none"
    if dtype == torch.bfloat16 and kernels is not None and hasattr(kernels, "bf16_linear"):
        return "kernels"
    if dtype == torch.float32 and _onednn_has_prepack():
        return "onednn"
    if dtype == torch.bfloat16 and _onednn_has_prepack() and cpu_path.can_pack_onednn_bf16():
        return "onednn"
    return "none"


class LinearLike(Protocol):
    """What the decoder needs from a matmul: the dense ``Linear`` below, or a quantised one
    (``quantization.gptq.QuantLinear``) that stores its weight differently."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` for x of shape [tokens, in_features]."""
        ...

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``."""
        ...


class Linear:
    """``x @ weight.T + bias``, optionally fused with a residual add, with the weight packed
    as ``packing`` says (see :func:`choose_packing`; ``kernels`` is the fused CPU extension,
    needed for "kernels")."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packing: Packing = "none",
        kernels: ModuleType | None = None,
    ) -> None:
        self.bias = bias
        self.packing = packing
        self.num_out = weight.shape[0]
        self.kernels = kernels if packing == "kernels" else None
        if packing == "kernels":
            if kernels is None or weight.dtype != torch.bfloat16:
                raise ValueError("kernels packing needs bfloat16 weights and the CPU kernels")
            self.weight = kernels.pack_bf16_weight(weight)
            # The kernel adds a float32 bias: converted once here, not on every call.
            self.bias = None if bias is None else bias.float()
        elif packing == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        else:
            self.weight = weight

    @property
    def is_packed(self) -> bool:
        """True when the plain weight was replaced by a packed copy."""
        return self.packing != "none"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.bf16_linear(x, self.weight, self.num_out, self.bias)
        if self.packing == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + linear(x)`` in one kernel where possible."""
        if self.kernels is not None:
            return residual + self(x)
        if self.packing == "onednn":
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, self.weight, self.bias, "add"
            )
        if self.bias is None:
            return torch.addmm(residual, x, self.weight.t())
        return residual + F.linear(x, self.weight, self.bias)
