"""Matrix products of the decoder, with oneDNN-prepacked weights on CPU when available.

On CPU, ``F.linear`` reorders (packs) the weight matrix into the kernel's blocked layout on
every call; packing once at load time makes the step's matmuls markedly faster here (about
1.2x in bfloat16 and 2.5x in float32 for this model's shapes on the 2-core AVX-512 machine).
Elsewhere (CUDA, or a torch without oneDNN) the plain ``F.linear`` path is used.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

# A typical decode batch: oneDNN picks its blocking for this M but accepts any M.
_PACK_BATCH_HINT = 32


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """True when oneDNN prepacked linear ops exist for this device and dtype."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


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
    """``x @ weight.T + bias``, optionally fused with a residual add."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, is_packed: bool) -> None:
        self.bias = bias
        self.is_packed = is_packed
        if is_packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + linear(x)`` in one kernel where possible."""
        if self.is_packed:
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, self.weight, self.bias, "add"
            )
        if self.bias is None:
            return torch.addmm(residual, x, self.weight.t())
        return residual + F.linear(x, self.weight, self.bias)
