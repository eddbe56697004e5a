"""AWQ int4 checkpoints (the Hugging Face layout AutoAWQ writes, ``version: "gemm"``).

Per quantised linear layer ``prefix`` (``in``/``out`` = in/out features):

* ``prefix.qweight`` int32 [in, out / 8]: eight 4-bit codes per int32 along the *output* dim;
* ``prefix.qzeros`` int32 [in / group_size, out / 8]: the zero points, packed the same way;
* ``prefix.scales`` float16 [in / group_size, out];
* optionally ``prefix.bias``.

The packing interleaves: nibble ``k`` of an int32 (lowest bits first) holds output column
``AWQ_ORDER[k]`` of its run of eight. ``W[i, o] = scales[g, o] * (q[i, o] - z[g, o])`` with
``g = i // group_size``; there is no g_idx and no act-order.

The loader turns each layer into GPTQ v2 tensors (the same codes, zeros and scales, packed
along the input dim), exactly, so the GPTQ paths (``quant_linear``, ``gptq_packed``) run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .gptq import GPTQConfig, GPTQFormatError

#: The output column (within a run of eight) held by nibble k of a packed int32.
AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class AWQConfig:
    """AutoAWQ's settings (``quantization_config`` with ``quant_method: awq``)."""

    group_size: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AWQConfig:
        """Validate the mapping; refuse by name what the reader does not handle."""
        version = str(d.get("version", "gemm")).lower()
        if version != "gemm":
            raise GPTQFormatError(f"AWQ version {version!r} is not supported (only gemm)")
        bits = int(d.get("bits", d.get("w_bit", 4)))
        if bits != 4:
            raise GPTQFormatError(f"AWQ bits={bits}: only 4-bit AWQ is supported")
        if not d.get("zero_point", True):
            raise GPTQFormatError("AWQ zero_point false (symmetric) is not supported")
        group = int(d.get("group_size", d.get("q_group_size", 128)))
        if group <= 0:
            raise GPTQFormatError(f"AWQ group_size {group} is not supported")
        return cls(group_size=group)

    def as_gptq(self) -> GPTQConfig:
        """The GPTQ settings of the converted tensors (v2: zeros stored as they are)."""
        return GPTQConfig(
            bits=4,
            group_size=self.group_size,
            desc_act=False,
            sym=False,
            checkpoint_format="gptq_v2",
        )


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [r, c] -> uint8 [r, c * 8] in the columns' own order (AWQ's interleave undone)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 15  # [r, c, 8] by nibble
    columns = torch.empty_like(nibbles)
    columns[..., list(AWQ_ORDER)] = nibbles
    return columns.reshape(packed.shape[0], -1).to(torch.uint8)


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [r, c] codes -> int32 [r / 8, c]: rows 8k..8k+7 in one int32, lowest bits first."""
    grouped = codes.to(torch.int32).view(-1, 8, codes.shape[1])
    packed = torch.zeros(grouped.shape[0], codes.shape[1], dtype=torch.int32)
    for j in range(8):
        packed |= grouped[:, j] << (4 * j)
    return packed


def awq_to_gptq(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One AWQ layer as GPTQ v2 tensors (``AWQConfig.as_gptq``): no value changes."""
    codes = unpack_awq(tensors["qweight"])  # [in, out]
    zeros = unpack_awq(tensors["qzeros"])  # [groups, out]
    if codes.shape[0] % 8:
        raise GPTQFormatError(f"AWQ layer with {codes.shape[0]} inputs: not a multiple of 8")
    converted = {
        "qweight": _pack_rows(codes),
        "qzeros": _pack_rows(zeros.t().contiguous()).t().contiguous(),
        "scales": tensors["scales"],
    }
    if "bias" in tensors:
        converted["bias"] = tensors["bias"]
    return converted


def dequantize_awq(
    tensors: dict[str, torch.Tensor], config: AWQConfig, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The reference dense weight [out, in] of one AWQ layer, straight from its tensors."""
    codes = unpack_awq(tensors["qweight"]).to(dtype)
    zeros = unpack_awq(tensors["qzeros"]).to(dtype)
    groups = torch.arange(codes.shape[0], device=codes.device) // config.group_size
    weight = (codes - zeros[groups]).mul_(tensors["scales"].to(dtype)[groups])
    return weight.t().contiguous()
