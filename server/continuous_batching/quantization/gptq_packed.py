"""GPTQ int4 layers repacked, exactly, into the packed layout the CPU kernels read
(``packed_gguf``, ``cpu_kernels/qgemm.h``), so a GPTQ checkpoint runs through the same fused
dequantise-and-multiply kernels as a GGUF file (float or int8 activations).

GPTQ's weight is ``s[g] * (q - z[g])`` per input channel of group ``g = g_idx[channel]``
(fp16 scale ``s``, 4-bit zero ``z``). In the layout, per 32 channels (one packed group):

* the codes ``q`` as 4-bit pairs (byte j: channel j low, channel j + 16 high);
* ``group_scale`` = 1 and ``group_offset`` = z (uint8), with ``super_scale`` =
  ``super_offset`` = s (float32) per super-block of ``group_size / 32`` packed groups (or of
  one, when the groups do not line up so);
* so a weight is ``s * q - s * z``: for an fp16 ``s`` and codes under 16 both products and
  their difference are exact in float32, the value ``dequantize_gptq`` computes, bit for bit.

Act-order (``desc_act``): the input channels are sorted by group (a stable sort of g_idx), the
codes in that order, and the layer permutes its input the same way before the matmul
(``PackedLinear.input_order``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import torch

from .gptq import GPTQConfig, default_g_idx, unpack_rows, unpack_zeros
from .packed_gguf import PackedWeight
from .packed_linear import ConcatLinear, PackedLinear, fused_packed_linear
from .quant_linear import KERNEL_GROUP_SIZES, cpu_kernel_available

logger = logging.getLogger(__name__)

_GROUP = 32  # the kernels' 4-bit group


class GPTQPackError(ValueError):
    """This GPTQ layer does not fit the packed layout (the caller keeps its int4 path)."""


def _nibble_pairs(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, K] codes 0..15 -> [rows, K / 2]: per 32, byte j = code j | code j+16 << 4."""
    rows, k = codes.shape
    grouped = codes.view(rows, k // _GROUP, 2, _GROUP // 2)
    return (grouped[:, :, 0] | (grouped[:, :, 1] << 4)).reshape(rows, k // 2).contiguous()


def pack_gptq(
    tensors: dict[str, torch.Tensor], config: GPTQConfig
) -> tuple[PackedWeight, torch.Tensor | None]:
    """One GPTQ layer (``qweight``, ``qzeros``, ``scales``, optional ``g_idx``) as a packed
    weight [out, in], and the input order it expects (None: the channels' own order).

    Raises GPTQPackError when the input size or a group is not a whole number of 32s."""
    codes = unpack_rows(tensors["qweight"], config.bits)  # [in, out]
    in_features, out_features = codes.shape
    if in_features % _GROUP:
        raise GPTQPackError(f"{in_features} input channels are not whole groups of {_GROUP}")
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        g_idx = default_g_idx(in_features, config.group_size, codes.device)
    g_idx = g_idx.long().cpu()
    order = torch.argsort(g_idx, stable=True)
    is_sorted = bool(torch.equal(order, torch.arange(in_features)))
    sorted_groups = g_idx[order].view(-1, _GROUP)
    if not bool((sorted_groups == sorted_groups[:, :1]).all()):
        raise GPTQPackError("a GPTQ group does not cover whole runs of 32 input channels")
    chunk_group = sorted_groups[:, 0]  # the GPTQ group of each packed group
    num_chunks = chunk_group.numel()
    per_super = max(1, config.group_size // _GROUP) if config.group_size > 0 else 1
    if num_chunks % per_super or not bool(
        (chunk_group.view(-1, per_super) == chunk_group.view(-1, per_super)[:, :1]).all()
    ):
        per_super = 1  # groups of uneven size: one super-block per packed group
    super_group = chunk_group.view(-1, per_super)[:, 0]
    scales = tensors["scales"].to(torch.float32).cpu()  # [groups, out]
    zeros = unpack_zeros(tensors["qzeros"], config).cpu()  # [groups, out]
    ordered = codes.cpu()[order] if not is_sorted else codes.cpu()
    super_scale = scales[super_group].t().contiguous()
    weight = PackedWeight(
        source="GPTQ int4",
        codes=_nibble_pairs(ordered.t().contiguous()),
        bits=4,
        group=_GROUP,
        group_scale=torch.ones(out_features, num_chunks, dtype=torch.uint8),
        group_offset=zeros[chunk_group].t().contiguous(),
        super_scale=super_scale,
        super_offset=super_scale.clone(),
    )
    return weight, None if is_sorted else order


@dataclass(frozen=True)
class GPTQPacking:
    """Builds a fused matmul's packed linear from its GPTQ parts (``gptq_cpu_kernel:
    packed``)."""

    kernels: ModuleType
    is_int8_activations: bool = False
    #: Leave the layers torch's int4 kernel takes to it (``gptq_cpu_kernel: auto``).
    is_auto: bool = False
    dtype: torch.dtype = torch.float32

    def takes(self, parts: list[dict[str, torch.Tensor]], config: GPTQConfig) -> bool:
        """True when these parts go packed: always, or (auto) where torch's int4 kernel does
        not apply and its portable path would dequantise the layer on every call."""
        if not self.is_auto:
            return True
        group = config.group_size
        is_torch = cpu_kernel_available(torch.device("cpu"), self.dtype) and all(
            group in KERNEL_GROUP_SIZES
            and part["qweight"].shape[0] * 32 // config.bits % group == 0
            and part["qweight"].shape[1] % 16 == 0
            for part in parts
        )
        return not is_torch

    def linear(
        self, parts: list[dict[str, torch.Tensor]], config: GPTQConfig
    ) -> PackedLinear | ConcatLinear | None:
        """One packed linear over the parts' stacked rows when their input orders agree, else
        one per part; None (the caller keeps torch's int4) when a part does not pack."""
        try:
            packed = [pack_gptq(part, config) for part in parts]
        except GPTQPackError as exc:
            logger.warning("GPTQ layer kept on torch's int4 kernel: %s", exc)
            return None
        weights = [w for w, _ in packed]
        biases = [part.get("bias") for part in parts]
        orders = [order for _, order in packed]
        return fused_packed_linear(weights, biases, self.kernels, self.is_int8_activations, orders)
