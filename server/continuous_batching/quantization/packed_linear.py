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

from .packed_gguf import PackedWeight, concat_rows


def kernels_can_pack(kernels: ModuleType | None) -> bool:
    """True when ``kernels`` (a loaded ``cpu_kernels`` module, or None) has the packed matmul."""
    return kernels is not None and hasattr(kernels, "quant_linear")


def has_int8_layout(weight: PackedWeight) -> bool:
    """True when the int8-activation kernel takes ``weight``: 4-bit codes in groups of 32 or
    8-bit codes in groups of 16 or 32, rows of whole 32-element steps (qgemm_i8.h)."""
    is_layout = (weight.bits, weight.group) in ((4, 32), (8, 32), (8, 16))
    return is_layout and weight.in_features % 32 == 0


def quantize_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` [M, K] as the int8 kernel sees it, dequantised (float32): per group of ``group``
    values (``PackedWeight.activation_group``), codes round(x * 127 / max|x|) (half to even)
    times max|x| / 127."""
    groups = x.float().reshape(x.shape[0], -1, group)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(groups * inverse).clamp_(-127, 127)
    return (codes * (amax / 127.0)).reshape(x.shape[0], -1)


class PackedLinear:
    """``x @ W.T + bias`` with W a ``PackedWeight``; output in x's dtype (float32 or bf16),
    computed in float32 and rounded once.

    ``is_int8_activations``: x is quantised to int8 per weight group (K-quants: per
    super-block) first, as llama.cpp does
    (integer dot products; about twice the speed of the float kernel), where the kernels and
    the weight's layout allow it (``self.is_int8``); the reference path quantises x the same
    way, so both paths compute the same product. On AVX512-BF16 builds a prefill in this mode
    (bf16 x of ``kernels.quant_panel_min_rows`` rows or more) multiplies the weight dequantised
    to bf16 instead (``qgemm_panels.h``: 1.4-1.8x the integer kernel's speed there); the plain
    path does not model that choice, the kernel tests check it.

    ``input_order``: the weight's columns are the input's channels in this order (a GPTQ
    act-order layer, its channels sorted by group): x is permuted to it first.
    """

    def __init__(
        self,
        weight: PackedWeight,
        bias: torch.Tensor | None,
        kernels: ModuleType | None,
        is_int8_activations: bool = False,
        input_order: torch.Tensor | None = None,
    ) -> None:
        self.weight = weight
        self.input_order = input_order
        # The kernel adds a float32 bias: converted once here.
        self.bias = None if bias is None else bias.float().contiguous()
        self.kernels = kernels if kernels_can_pack(kernels) else None
        self.num_out = weight.num_rows
        # Without kernels (the reference) the request stands; a kernels build without the
        # int8 kernel (no AVX2) runs float activations.
        is_built = self.kernels is None or getattr(self.kernels, "has_int8_activations", False)
        self.is_int8 = is_int8_activations and has_int8_layout(weight) and is_built
        # AVX512-VNNI and AVX2 builds run the super-block layouts with the weight's rows in the
        # lanes, from tiles made here once (qgemm_lanes.h); the plain layout is not kept.
        if self.is_int8 and getattr(self.kernels, "has_lane_tiles", False) and weight.can_lane_tile:
            self.weight = weight.lane_tiled(self.kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.kernels is None or x.dtype not in (torch.float32, torch.bfloat16):
            return self.reference(x)
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
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
            is_int8_activations=self.is_int8,
            is_tiled=w.is_lane_tiled,
        )

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The plain path: dequantise the whole weight (float32) and multiply (x quantised
        first when ``is_int8``)."""
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        x_used = (
            quantize_activations(x, self.weight.activation_group) if self.is_int8 else x.float()
        )
        return F.linear(x_used, self.weight.dequantize(), self.bias).to(x.dtype)

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


def fused_packed_linear(
    weights: list[PackedWeight],
    biases: list[torch.Tensor | None],
    kernels: ModuleType | None,
    is_int8_activations: bool = False,
    input_orders: list[torch.Tensor | None] | None = None,
) -> PackedLinear | ConcatLinear:
    """A fused matmul (q/k/v, gate/up) over packed parts: one ``PackedLinear`` over their
    stacked rows when their layouts and input orders agree, else a ``ConcatLinear`` of one
    per run of neighbouring parts that agree. In a group where some part has a bias, the others
    get zeros."""
    orders = input_orders or [None] * len(weights)
    if any(b is not None for b in biases):
        pairs = zip(weights, biases, strict=True)
        biases = [torch.zeros(w.num_rows) if b is None else b.float() for w, b in pairs]
    # Runs of neighbouring parts with one layout and input order are stacked into one packed
    # weight (Q4_K_M's Q4_K q and k, beside its Q6_K v): one matmul call each.
    runs: list[list[int]] = []
    for i, weight in enumerate(weights):
        if runs and _is_stackable(weights[runs[-1][0]], orders[runs[-1][0]], weight, orders[i]):
            runs[-1].append(i)
        else:
            runs.append([i])
    linears = [_stacked(run, weights, biases, orders, kernels, is_int8_activations) for run in runs]
    return linears[0] if len(linears) == 1 else ConcatLinear(linears)


def _is_stackable(
    a: PackedWeight, a_order: torch.Tensor | None, b: PackedWeight, b_order: torch.Tensor | None
) -> bool:
    """True when ``b``'s rows can join ``a``'s in one packed weight."""
    if a.layout_key() != b.layout_key() or (a_order is None) != (b_order is None):
        return False
    return a_order is None or torch.equal(a_order, b_order)


def _stacked(
    run: list[int],
    weights: list[PackedWeight],
    biases: list[torch.Tensor | None],
    orders: list[torch.Tensor | None],
    kernels: ModuleType | None,
    is_int8_activations: bool,
) -> PackedLinear:
    """One ``PackedLinear`` over the parts ``run`` (indices), their rows stacked."""
    weight = concat_rows([weights[i] for i in run]) if len(run) > 1 else weights[run[0]]
    bias = None if biases[run[0]] is None else torch.cat([biases[i] for i in run])  # type: ignore[misc]
    return PackedLinear(weight, bias, kernels, is_int8_activations, orders[run[0]])
