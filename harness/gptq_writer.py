"""An independent GPTQ checkpoint writer for the tests and the int4 benchmark (no code shared
with the engine's reader).

It quantises linear layers with AutoGPTQ's min-max asymmetric 4-bit quantiser (round to
nearest, per group; no calibration: the tests check the *format*), packs them the way AutoGPTQ
does (numpy, eight codes per int32, lowest bits first; v1 stores ``zero - 1``) and writes a
folder like AutoGPTQ / GPTQModel save: safetensors + quantize_config.json and/or config.json's
``quantization_config`` + tokenizer files.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Projections that see the same input share the act-order permutation (as in GPTQ).
SAME_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass
class Quantized:
    """One layer's integer codes as the quantiser made them (before any packing)."""

    codes: torch.Tensor  # [in, out] int64 in 0..15
    zeros: torch.Tensor  # [groups, out] int64 in 0..15
    scales: torch.Tensor  # [groups, out] float16
    g_idx: torch.Tensor  # [in] int32

    def dequantize(self) -> torch.Tensor:
        """The reference float32 weight [out, in]: scale * (code - zero) of each row's group."""
        g = self.g_idx.long()
        return (self.scales.float()[g] * (self.codes - self.zeros[g]).float()).t().contiguous()


def rtn_quantize(weight: torch.Tensor, group_size: int, order: torch.Tensor) -> Quantized:
    """AutoGPTQ's min-max asymmetric 4-bit quantiser per group; groups are consecutive runs of
    input rows in ``order`` (act-order when it is a permutation), as GPTQ forms them."""
    w = weight.t().float()
    in_features, out = w.shape
    num_groups = -(-in_features // group_size)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // group_size).int()
    codes = torch.empty((in_features, out), dtype=torch.long)
    zeros = torch.empty((num_groups, out), dtype=torch.long)
    scales = torch.empty((num_groups, out), dtype=torch.float16)
    for g in range(num_groups):
        rows = order[g * group_size : (g + 1) * group_size]
        x = w[rows]
        xmin, xmax = x.min(0).values.clamp(max=0), x.max(0).values.clamp(min=0)
        scale = ((xmax - xmin) / 15).clamp(min=1e-6).half()  # stored in float16
        zero = torch.round(-xmin / scale.float()).clamp(0, 15)
        codes[rows] = torch.clamp(torch.round(x / scale.float()) + zero, 0, 15).long()
        zeros[g], scales[g] = zero.long(), scale
    return Quantized(codes, zeros, scales, g_idx)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's packing: int32 row r holds rows 8r..8r+7, the first in the lowest 4 bits."""
    arr = values.numpy().astype(np.uint32)
    packed = np.zeros((arr.shape[0] // 8, arr.shape[1]), dtype=np.uint32)
    for j in range(8):
        packed |= arr[j::8] << np.uint32(4 * j)
    return torch.from_numpy(packed.view(np.int32))


def pack_layer(q: Quantized, fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one layer. v1 stores ``zero - 1``; AutoGPTQ does not mask it,
    so a zero of 0 would spill into the neighbouring nibbles: we keep it within its 4 bits."""
    stored = (q.zeros - 1) & 15 if fmt == "gptq" else q.zeros
    return {
        "qweight": pack_rows(q.codes),
        "qzeros": pack_rows(stored.t().contiguous()).t().contiguous(),
        "scales": q.scales,
        "g_idx": q.g_idx,
    }


def write_checkpoint(
    folder: Path,
    model_path: Path,
    source: dict[str, torch.Tensor],
    *,
    fmt: str,
    group_size: int,
    desc_act: bool,
    weights_name: str = "model.safetensors",
    config_in: tuple[str, ...] = ("quantize_config", "config"),
) -> dict[str, torch.Tensor]:
    """Quantise every linear layer, write a GPTQ folder, return the reference state dict."""
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    perms: dict[str, torch.Tensor] = {}
    for name, weight in source.items():
        prefix, _, _ = name.rpartition(".")
        kind = prefix.rpartition(".")[2]
        if kind not in LINEARS:
            tensors[name] = weight.half()  # AutoGPTQ saves the rest in float16
            reference[name] = tensors[name].float()
            continue
        in_features = weight.shape[1]
        key = f"{prefix.rpartition('.')[0]}.{SAME_INPUT.get(kind, kind)}"
        if desc_act and key not in perms:
            perms[key] = torch.randperm(in_features, generator=gen)
        order = perms[key] if desc_act else torch.arange(in_features)
        q = rtn_quantize(weight, group_size, order)
        tensors.update({f"{prefix}.{k}": v for k, v in pack_layer(q, fmt).items()})
        reference[name] = q.dequantize()
    save_file(tensors, str(folder / weights_name), metadata={"format": "pt"})
    quant_config = {
        "bits": 4,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": False,
        "true_sequential": True,
        "static_groups": False,
        "damp_percent": 0.01,
        "quant_method": "gptq",
        "checkpoint_format": fmt,
        "model_file_base_name": weights_name.removesuffix(".safetensors"),
    }
    config = json.loads((model_path / "config.json").read_text())
    config["dtype"] = "float16"
    if "config" in config_in:
        config["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(config))
    if "quantize_config" in config_in:
        (folder / "quantize_config.json").write_text(json.dumps(quant_config))
    for file in (*TOKENIZER_FILES, "generation_config.json"):
        shutil.copy(model_path / file, folder / file)
    return reference
