"""The int4 GPTQ matmul: the weight stays at 4 bits and is dequantised inside each call.

Two backends, same numbers up to rounding:

* torch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``, what torchao's int4 CPU
  path uses) for bfloat16/float16 compute, when the layout fits it (equal groups of 32, 64,
  128 or 256 rows, ``out % 16 == 0``). It dequantises tile by tile in registers: at decode
  batch sizes it beats the dense bfloat16 matmul, which has to stream four times the bytes;
  at prefill sizes (hundreds of tokens) it is slower than dequantise-then-matmul.
* on CUDA with Triton, one Triton kernel (``triton_int4``) over the portable layout below,
  dequantising tile by tile in registers (any group layout, act-order included);
* a portable path (any device, any dtype, any group layout): unpack the codes into a
  compute-dtype weight, subtract the zero points, scale, then a dense matmul. It costs a few
  elementwise passes over the weight per call; it is the reference the kernels are tested
  against.

The kernel's dequantisation is ``(q - 8) * scale + zero`` with a zero in weight units; GPTQ's
``scale * (q - zero_point)`` maps onto it as ``zero = scale * (8 - zero_point)``.
"""

from __future__ import annotations

import torch

from . import triton_int4
from .gptq import GPTQConfig, default_g_idx, unpack_rows, unpack_zeros

#: Use torch's CPU int4 kernel where it applies (the benchmark switches it off to compare).
CPU_KERNEL_ENABLED = True
KERNEL_GROUP_SIZES = (32, 64, 128, 256)


def cpu_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when torch's CPU int4 matmul exists for this device and compute dtype (its
    float32 variant is not vectorised here, so float32 takes the portable path)."""
    return (
        CPU_KERNEL_ENABLED
        and device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float16)
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")
    )


class QuantLinear:
    """``x @ W + bias`` with W held as 4-bit codes (see the module docstring).

    Portable layout (4 bits a weight, like the checkpoint, but cheap to unpack): input rows
    sorted by group (``perm``, act-order checkpoints only; inputs are gathered in that order),
    and ``packed`` uint8 [in / 2, out] holding row ``i`` in the low nibble and row
    ``i + in / 2`` in the high one. Zero points and scales stay unpacked in the compute dtype
    ([groups, out], small). ``use_cpu_kernel`` converts to the kernel's layout.
    """

    def __init__(
        self,
        packed: torch.Tensor,
        zeros: torch.Tensor,
        scales: torch.Tensor,
        perm: torch.Tensor | None,
        row_groups: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        self.packed: torch.Tensor | None = packed
        self.zeros: torch.Tensor | None = zeros
        self.scales: torch.Tensor | None = scales
        #: Input gather order (act-order checkpoints), else None.
        self.perm = perm
        #: Group of each (sorted) row when groups are not equal consecutive runs, else None.
        self.row_groups = row_groups
        self.bias = bias
        self.in_features = 2 * packed.shape[0]
        self.out_features = packed.shape[1]
        self.num_groups = scales.shape[0]
        self.dtype = scales.dtype
        #: (kernel-packed weight, scales-and-zeros [groups, out, 2], group size) once converted.
        self.kernel: tuple[torch.Tensor, torch.Tensor, int] | None = None
        #: int32 group of every (sorted) input row, built for the Triton kernel on first use.
        self.g_idx: torch.Tensor | None = None

    @classmethod
    def from_gptq(
        cls,
        tensors: dict[str, torch.Tensor],
        config: GPTQConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> QuantLinear:
        """Build from one layer's checkpoint tensors (``QUANT_SUFFIXES`` plus optional bias)."""
        codes = unpack_rows(tensors["qweight"].to(device), config.bits)
        in_features = codes.shape[0]
        zeros = unpack_zeros(tensors["qzeros"].to(device), config)
        scales = tensors["scales"].to(device=device, dtype=dtype)
        g_idx = tensors.get("g_idx")
        if g_idx is None:
            g_idx = default_g_idx(in_features, config.group_size, device)
        g_idx = g_idx.to(device=device, dtype=torch.long)
        perm = None
        if bool((g_idx[1:] < g_idx[:-1]).any()):
            perm = torch.argsort(g_idx, stable=True)
            codes, g_idx = codes[perm], g_idx[perm]
        num_groups = scales.shape[0]
        counts = torch.bincount(g_idx, minlength=num_groups)
        uniform = in_features % num_groups == 0 and bool(
            (counts == in_features // num_groups).all()
        )
        half = in_features // 2
        bias = tensors.get("bias")
        return cls(
            packed=codes[:half] | (codes[half:] << 4),
            zeros=zeros.to(dtype).contiguous(),  # unpacked as a transposed view
            scales=scales,
            perm=perm,
            row_groups=None if uniform else g_idx,
            bias=None if bias is None else bias.to(device=device, dtype=dtype),
        )

    @staticmethod
    def can_concat(parts: list[QuantLinear]) -> bool:
        """True when the parts share their input-row layout (same g_idx), so their packed
        tensors can be joined along the output dim into one matmul."""
        first = parts[0]
        return all(
            p.kernel is None
            and p.in_features == first.in_features
            and p.num_groups == first.num_groups
            and _same(p.perm, first.perm)
            and _same(p.row_groups, first.row_groups)
            for p in parts
        )

    @classmethod
    def concat(cls, parts: list[QuantLinear]) -> QuantLinear:
        """One QuantLinear computing the parts' outputs side by side (q|k|v, gate|up)."""
        if not cls.can_concat(parts):
            raise ValueError("QuantLinear parts with different g_idx cannot be concatenated")
        biases = [p.bias if p.bias is not None else torch.zeros_like(p.scales[0]) for p in parts]
        return cls(
            packed=torch.cat([p.packed for p in parts], dim=1),
            zeros=torch.cat([p.zeros for p in parts], dim=1),
            scales=torch.cat([p.scales for p in parts], dim=1),
            perm=parts[0].perm,
            row_groups=parts[0].row_groups,
            bias=torch.cat(biases) if any(p.bias is not None for p in parts) else None,
        )

    def use_cpu_kernel(self) -> bool:
        """Switch to torch's CPU int4 kernel if it applies (dropping the portable tensors, so
        memory stays at 4 bits a weight); returns whether it did."""
        group_size = self.in_features // self.num_groups
        if (
            self.kernel is not None
            or not cpu_kernel_available(self.packed.device, self.dtype)
            or self.row_groups is not None
            or group_size not in KERNEL_GROUP_SIZES
            or self.out_features % 16
        ):
            return self.kernel is not None
        codes = torch.cat((self.packed & 15, self.packed >> 4))  # [in, out]
        # innerKTiles only matters for the CUDA layout; 8 is torchao's value.
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.t().int(), 8)
        scales, zeros = self.scales.float(), self.zeros.float()
        scales_zeros = torch.stack((scales, scales * (8 - zeros)), dim=-1).to(self.dtype)
        self.kernel = (weight, scales_zeros.contiguous(), group_size)
        self.packed = self.zeros = self.scales = None
        return True

    @property
    def nbytes(self) -> int:
        """Bytes held by this layer's tensors."""
        tensors = [self.packed, self.zeros, self.scales, self.perm, self.row_groups, self.bias]
        tensors.append(self.g_idx)
        tensors += list(self.kernel[:2]) if self.kernel else []
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows already in ``perm`` order, [n, in]) @ W, no bias."""
        if self.kernel is not None:
            weight, scales_zeros, group_size = self.kernel
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.contiguous(), weight, group_size, scales_zeros
            )
        if self.uses_triton:
            return triton_int4.int4_matmul(
                x, self.packed, self.zeros, self.scales, self.row_group_index()
            )
        return torch.mm(x, self.weight())

    @property
    def uses_triton(self) -> bool:
        """True when the Triton int4 kernel runs this layer (CUDA with Triton)."""
        return self.kernel is None and triton_int4.is_available(self.packed.device)

    def row_group_index(self) -> torch.Tensor:
        """The group of every (sorted) input row, int32 [in] (built once)."""
        if self.g_idx is None:
            if self.row_groups is not None:
                groups = self.row_groups
            else:
                size = self.in_features // self.num_groups
                groups = torch.arange(self.in_features, device=self.packed.device) // size
            self.g_idx = groups.to(torch.int32).contiguous()
        return self.g_idx

    def weight(self) -> torch.Tensor:
        """The dequantised weight [in, out] (rows in ``perm`` order) in the compute dtype."""
        if self.kernel is not None:  # only for inspection: identity rows through the kernel
            eye = torch.eye(self.in_features, dtype=self.dtype, device=self.kernel[0].device)
            return self._matmul(eye)
        half, out = self.packed.shape
        w = torch.empty((2 * half, out), dtype=self.dtype, device=self.packed.device)
        w[:half] = self.packed & 15
        w[half:] = self.packed >> 4
        if self.row_groups is None:
            # (q - zero) is exact in any float dtype, so the multiply is the one rounding.
            groups = w.view(self.num_groups, -1, out)
            groups.sub_(self.zeros[:, None]).mul_(self.scales[:, None])
        else:
            w.sub_(self.zeros[self.row_groups]).mul_(self.scales[self.row_groups])
        return w

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, self.in_features)
        return x if self.perm is None else x.index_select(1, self.perm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W + bias`` for x [..., in]."""
        y = self._matmul(self._input(x))
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` for 2-D x and residual (the add fused where possible)."""
        x = self._input(x)
        if self.kernel is not None or self.uses_triton:
            y = self._matmul(x).add_(residual)
        else:
            y = torch.addmm(residual, x, self.weight())
        return y if self.bias is None else y.add_(self.bias)


class ConcatLinear:
    """Several matmuls over the same input whose outputs are concatenated: the fallback when
    fused projections were quantised with different act-orders (g_idx)."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        self.parts = parts

    @property
    def nbytes(self) -> int:
        """Bytes held by the parts."""
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The parts' outputs side by side."""
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``."""
        return residual + self(x)


def fuse(parts: list[QuantLinear]) -> QuantLinear | ConcatLinear:
    """The matmul for fused projections (one part for o_proj/down): one QuantLinear when their
    g_idx agree (always without act-order), else the parts one after the other; then moved to
    torch's CPU int4 kernel where it applies."""
    layer = parts[0] if len(parts) == 1 else None
    if layer is None and QuantLinear.can_concat(parts):
        layer = QuantLinear.concat(parts)
    if layer is None:
        for part in parts:
            part.use_cpu_kernel()
        return ConcatLinear(parts)
    layer.use_cpu_kernel()
    return layer


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))
