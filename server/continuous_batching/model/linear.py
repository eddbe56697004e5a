"""Matrix products of the decoder, with oneDNN-prepacked weights on CPU when available.

On CPU, ``F.linear`` reorders (packs) the weight matrix into the kernel's blocked layout on
every call; packing once at load time makes the step's matmuls markedly faster here (about
1.2x in bfloat16 and 2.5x in float32 for this model's shapes on the 2-core AVX-512 machine).
Elsewhere (CUDA, or a torch without oneDNN) the plain ``F.linear`` path is used. With the
fused CPU kernels built for a CPU with AVX512-BF16, bfloat16 weights use the extension's own
matmul instead (``bf16_linear``: faster than oneDNN here for decode-sized batches, as fast for
prefill; see cpu_kernels.cpp).
"""

from __future__ import annotations

from types import ModuleType
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
    """``x @ weight.T + bias``, optionally fused with a residual add.

    Prepacked (``is_packed``): a bfloat16 weight goes to the fused CPU kernels' own matmul when
    ``kernels`` (the extension) is given and has it, else to oneDNN's blocked layout."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        is_packed: bool,
        kernels: ModuleType | None = None,
    ) -> None:
        self.bias = bias
        self.is_packed = is_packed
        self.num_out = weight.shape[0]
        self.kernels = (
            kernels
            if is_packed
            and kernels is not None
            and getattr(kernels, "has_bf16_gemm", False)
            and weight.dtype == torch.bfloat16
            else None
        )
        if self.kernels is not None:
            self.weight = self.kernels.pack_bf16_weight(weight)
            # The kernel adds a float32 bias: converted once here, not on every call.
            self.bias = None if bias is None else bias.float()
        elif is_packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.bf16_linear(x, self.weight, self.num_out, self.bias)
        if self.is_packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + linear(x)`` in one kernel where possible."""
        if self.kernels is not None:
            return residual + self(x)
        if self.is_packed:
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, self.weight, self.bias, "add"
            )
        if self.bias is None:
            return torch.addmm(residual, x, self.weight.t())
        return residual + F.linear(x, self.weight, self.bias)
