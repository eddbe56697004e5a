"""Quantised checkpoint formats: GPTQ int4 (``gptq`` for the format, ``quant_linear`` for the
packed matmul) and AWQ int4 (``awq``, converted to GPTQ's form; ``checkpoint_formats`` picks)."""

from .gptq import GPTQConfig, GPTQFormatError, dequantize_gptq, read_gptq_config
from .quant_linear import ConcatLinear, QuantLinear, fuse

__all__ = [
    "ConcatLinear",
    "GPTQConfig",
    "GPTQFormatError",
    "QuantLinear",
    "dequantize_gptq",
    "fuse",
    "read_gptq_config",
]
