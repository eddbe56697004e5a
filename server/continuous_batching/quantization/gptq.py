"""GPTQ int4 checkpoints (the Hugging Face layout AutoGPTQ and GPTQModel write) in plain torch.

Per quantised linear layer ``prefix`` the checkpoint holds (``in``/``out`` = in/out features):

* ``prefix.qweight`` int32 [in / 8, out]: eight 4-bit codes per int32 along the input dim,
  lowest bits first;
* ``prefix.qzeros`` int32 [groups, out / 8]: the zero points, packed the same way along out;
* ``prefix.scales`` float16 [groups, out];
* ``prefix.g_idx`` int32 [in]: the group of each input row (``row // group_size`` unless the
  model was quantised with ``desc_act``, whose act-order makes it a permutation-dependent map);
* optionally ``prefix.bias``.

The weight is ``W[i, o] = scales[g, o] * (q[i, o] - zero[g, o])`` with ``g = g_idx[i]``. The v1
format (``checkpoint_format: "gptq"``, AutoGPTQ) stores ``zero - 1``; readers add the 1 back
within 4 bits (as AutoGPTQ's own torch kernel does). ``gptq_v2`` (GPTQModel) stores the zero.

This module reads the format (settings, files, tensors, unpacking, a reference dequantiser);
``quant_linear.QuantLinear`` runs the packed weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

#: Tensor-name suffixes of one quantised layer (besides its optional ``bias``).
QUANT_SUFFIXES: tuple[str, ...] = ("qweight", "qzeros", "scales", "g_idx")
_FORMATS: tuple[str, ...] = ("gptq", "gptq_v2")


class GPTQFormatError(ValueError):
    """The checkpoint is GPTQ but in a variant this reader does not handle."""


@dataclass(frozen=True)
class GPTQConfig:
    """The quantisation settings that decide how the packed tensors are read."""

    bits: int
    group_size: int
    desc_act: bool
    sym: bool
    checkpoint_format: str

    @property
    def zero_offset(self) -> int:
        """What to add to a stored zero point: 1 for the v1 format, 0 for v2."""
        return 1 if self.checkpoint_format == "gptq" else 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTQConfig:
        """Validate a ``quantize_config.json`` (or ``quantization_config``) mapping."""
        method = d.get("quant_method", "gptq")
        if method != "gptq":
            raise GPTQFormatError(f"quant_method {method!r} is not gptq")
        if d.get("is_marlin_format"):
            raise GPTQFormatError("the Marlin repacked GPTQ format is not supported")
        # GPTQModel writes "checkpoint_format" (some versions "format"); AutoGPTQ may omit it.
        fmt = str(d.get("checkpoint_format") or d.get("format") or "gptq")
        if fmt not in _FORMATS:
            raise GPTQFormatError(f"checkpoint_format {fmt!r} is not one of {list(_FORMATS)}")
        if int(d.get("bits", 4)) != 4:
            raise GPTQFormatError(f"bits={d.get('bits')}: only 4-bit GPTQ is supported")
        if str(d.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise GPTQFormatError(f"pack_dtype {d.get('pack_dtype')!r}: only int32 packing")
        return cls(
            bits=4,
            group_size=int(d.get("group_size", 128)),
            desc_act=bool(d.get("desc_act", False)),
            sym=bool(d.get("sym", True)),
            checkpoint_format=fmt,
        )


def read_quant_settings(
    folder: str | Path, config_base_name: str | None = None
) -> tuple[dict[str, Any], bool] | None:
    """The folder's quantisation settings and whether they come from a settings file of their
    own (None: no settings, a dense checkpoint).

    Looked up in ``<config_base_name>.json`` if given (it must exist), else
    ``quantize_config.json``, else ``config.json``'s ``quantization_config`` (any method).
    """
    folder = Path(folder)
    if config_base_name:
        path = folder / f"{config_base_name.removesuffix('.json')}.json"
        if not path.is_file():
            raise FileNotFoundError(f"GPTQ config {path} not found")
        return json.loads(path.read_text()), True
    if (folder / "quantize_config.json").is_file():
        return json.loads((folder / "quantize_config.json").read_text()), True
    config_file = folder / "config.json"
    if config_file.is_file():
        quant = json.loads(config_file.read_text()).get("quantization_config")
        if isinstance(quant, dict):
            return quant, False
    return None


def read_gptq_config(folder: str | Path, config_base_name: str | None = None) -> GPTQConfig | None:
    """The folder's GPTQ settings, or None when it is not a GPTQ checkpoint (a settings file of
    its own is read as GPTQ; config.json's ``quantization_config`` only when it says gptq)."""
    found = read_quant_settings(folder, config_base_name)
    if found is None or not (found[1] or found[0].get("quant_method") == "gptq"):
        return None
    return GPTQConfig.from_dict(found[0])


def gptq_files(folder: str | Path, model_base_name: str | None = None) -> list[Path]:
    """The checkpoint's safetensors files: ``<model_base_name>.safetensors`` when given (e.g.
    AutoGPTQ's ``gptq_model-4bit-128g``), else the shards of the index file, else every
    ``*.safetensors`` in the folder (``model.safetensors`` as GPTQModel and transformers save)."""
    folder = Path(folder)
    if model_base_name:
        path = folder / f"{model_base_name.removesuffix('.safetensors')}.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"GPTQ weights {path} not found")
        return [path]
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in GPTQ model folder {folder}")
    return files


def split_gptq_checkpoint(
    files: list[Path],
) -> tuple[dict[str, dict[str, torch.Tensor]], list[tuple[Path, str]]]:
    """Read every quantised layer's tensors, keyed by layer prefix then suffix (they are small:
    4 bits a weight), and list the (file, name) of the other, dense tensors (embeddings, norms,
    unquantised layers) for the caller to stream one at a time."""
    names: list[tuple[Path, str]] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.extend((file, name) for name in f.keys())  # noqa: SIM118
    prefixes = {name.removesuffix(".qweight") for _, name in names if name.endswith(".qweight")}
    quantized: dict[str, dict[str, torch.Tensor]] = {p: {} for p in prefixes}
    dense: list[tuple[Path, str]] = []
    by_file: dict[Path, list[str]] = {}
    for file, name in names:
        prefix, _, suffix = name.rpartition(".")
        if prefix in prefixes and suffix in (*QUANT_SUFFIXES, "bias"):
            by_file.setdefault(file, []).append(name)
        else:
            dense.append((file, name))
    for file, wanted in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in wanted:
                prefix, _, suffix = name.rpartition(".")
                quantized[prefix][suffix] = f.get_tensor(name)
    for prefix, parts in quantized.items():
        missing = [s for s in ("qweight", "qzeros", "scales") if s not in parts]
        if missing:
            raise GPTQFormatError(f"quantised layer {prefix!r} lacks {missing}")
    return quantized, dense


def unpack_rows(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [r, c] -> uint8 [r * 32 / bits, c]: each int32 holds ``32 / bits`` codes of
    consecutive rows, lowest bits first. (The arithmetic shift of negative int32s is harmless:
    the mask drops the sign bits.)"""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    codes = (packed.to(torch.int32).unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)
    return codes.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_zeros(qzeros: torch.Tensor, config: GPTQConfig) -> torch.Tensor:
    """qzeros int32 [groups, out / 8] -> zero points uint8 [groups, out], offset applied.
    The mask keeps v1's ``0 - 1`` (stored as 15 within the nibble) mapping back to 0."""
    stored = unpack_rows(qzeros.t(), config.bits).t()
    return (stored + config.zero_offset) & ((1 << config.bits) - 1)


def default_g_idx(in_features: int, group_size: int, device: torch.device) -> torch.Tensor:
    """The g_idx of a checkpoint without act-order: consecutive rows share a group."""
    size = in_features if group_size <= 0 else group_size
    return torch.arange(in_features, device=device) // size


def dequantize_gptq(
    tensors: dict[str, torch.Tensor], config: GPTQConfig, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The dense weight [out, in] (Hugging Face ``nn.Linear`` layout) of one quantised layer;
    ``tensors`` maps the suffixes in ``QUANT_SUFFIXES`` (g_idx optional) to tensors."""
    codes = unpack_rows(tensors["qweight"], config.bits)
    zeros = unpack_zeros(tensors["qzeros"], config)
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        g_idx = default_g_idx(codes.shape[0], config.group_size, codes.device)
    g_idx = g_idx.long()
    scales = tensors["scales"].to(dtype)
    # (q - zero) is an exact small integer, so one rounding happens: in the multiply.
    weight = (codes.to(dtype) - zeros.to(dtype)[g_idx]).mul_(scales[g_idx])
    return weight.t().contiguous()
