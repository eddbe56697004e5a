"""Which quantised checkpoint format a folder holds, decided in one place.

Each format says whether it takes a folder's quantisation settings, what GPTQ settings its
layers have once converted, and how to convert one layer's tensors into GPTQ's (the form the
int4 and packed kernels run). GPTQ takes its own files and ``quant_method: gptq``; AWQ
(``quant_method: awq``) converts exactly (``awq``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from .awq import AWQConfig, awq_to_gptq
from .gptq import GPTQConfig, read_quant_settings

Tensors = dict[str, torch.Tensor]


class QuantFormat(Protocol):
    """One quantised checkpoint format the loader reads through the GPTQ paths."""

    name: str

    def takes(self, settings: dict[str, Any], is_own_file: bool) -> bool:
        """True when these settings describe a checkpoint of this format."""
        ...

    def gptq_config(self, settings: dict[str, Any]) -> GPTQConfig:
        """The GPTQ settings of the converted layers (raises GPTQFormatError if unsupported)."""
        ...

    def convert(self, tensors: Tensors) -> Tensors:
        """One layer's tensors as GPTQ tensors."""
        ...


class GPTQFormat:
    """GPTQ as AutoGPTQ and GPTQModel write it: the layers are GPTQ's already."""

    name = "gptq"

    def takes(self, settings: dict[str, Any], is_own_file: bool) -> bool:
        # AutoGPTQ's quantize_config.json may leave quant_method out: GPTQ's from_dict judges.
        return is_own_file or settings.get("quant_method") == "gptq"

    def gptq_config(self, settings: dict[str, Any]) -> GPTQConfig:
        return GPTQConfig.from_dict(settings)

    def convert(self, tensors: Tensors) -> Tensors:
        return tensors


class AWQFormat:
    """AutoAWQ's ``gemm`` layout, each layer repacked exactly into GPTQ v2 tensors."""

    name = "awq"

    def takes(self, settings: dict[str, Any], is_own_file: bool) -> bool:
        return settings.get("quant_method") == "awq"

    def gptq_config(self, settings: dict[str, Any]) -> GPTQConfig:
        return AWQConfig.from_dict(settings).as_gptq()

    def convert(self, tensors: Tensors) -> Tensors:
        return awq_to_gptq(tensors)


#: In order of preference: the first that takes a folder's settings reads it.
FORMATS: tuple[QuantFormat, ...] = (AWQFormat(), GPTQFormat())


@dataclass(frozen=True)
class QuantCheckpoint:
    """A quantised folder's format and the GPTQ settings of its converted layers."""

    format: QuantFormat
    config: GPTQConfig


def read_quant_checkpoint(
    folder: str | Path, config_base_name: str | None = None
) -> QuantCheckpoint | None:
    """The folder's quantised format, or None for a dense checkpoint (no settings, or
    config.json's ``quantization_config`` of a method no format takes)."""
    found = read_quant_settings(folder, config_base_name)
    if found is None:
        return None
    settings, is_own_file = found
    for fmt in FORMATS:
        if fmt.takes(settings, is_own_file):
            return QuantCheckpoint(fmt, fmt.gptq_config(settings))
    return None
