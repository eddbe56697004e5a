"""A dense checkpoint quantised at load (``model_loading_config.quantize_method: int8 | int4``,
``llm-suite serve --quantization``): each layer's four matmuls and the lm_head become packed
weights that the CPU kernels read (``quantization.packed_gguf``), so a bf16 folder runs at
about a quarter (int4) or half (int8) of its matmul bytes.

The quantisation is llama.cpp's own round-to-nearest, computed by ``gguf.quants``:

* ``int8``: Q8_0 (int8 codes, one fp16 scale per 32 weights, 8.5 bits a weight);
* ``int4``: Q4_1 (4-bit codes, an fp16 scale and minimum per 32 weights, 5 bits a weight;
  closer than Q4_0's symmetric codes at the same packed size);
* the lm_head: Q8_0 in both, as llama.cpp keeps its output matrix at 6-8 bits (the logits
  are the most sensitive matmul); the embedding stays dense (a gather).

A matmul whose rows are not whole 32-weight groups, and the experts of a mixture, stay dense.
Where the packed kernels cannot run (no kernels, the generic path), every quantised weight is
replaced by its dequantised value instead (rounded to the compute dtype; the lm_head's kept in
float32): the same numbers at the compute dtype's memory, the reference the tests compare the
kernels with.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from ..quantization.packed_gguf import PackedWeight, repack
from ..quantization.packed_linear import PackedLinear, kernels_can_pack
from .decoder_layer import DENSE_PARAMS
from .linear import Linear
from .llama import LlamaForCausalLM

#: ``quantize_method`` -> the GGUF type its layer matmuls are quantised to.
AT_LOAD_TYPES: dict[str, T] = {"int8": T.Q8_0, "int4": T.Q4_1}
#: The lm_head's type for either method.
LM_HEAD_TYPE = T.Q8_0
_GROUP = 32  # Q8_0 and Q4_1 blocks


def _quantized_bytes(weight: torch.Tensor, qtype: T) -> np.ndarray:
    """llama.cpp's blocks of ``weight`` ([rows, K], K a multiple of 32) as uint8 rows."""
    return quantize(weight.detach().to(torch.float32).cpu().numpy(), qtype)


def quantize_matrix(weight: torch.Tensor, qtype: T) -> PackedWeight:
    """``weight`` quantised to ``qtype`` and repacked for the kernels."""
    return repack(_quantized_bytes(weight, qtype), qtype)


def round_trip(weight: torch.Tensor, qtype: T, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``weight`` quantised to ``qtype`` and dequantised back, in ``dtype`` (default: its
    own)."""
    values = dequantize(_quantized_bytes(weight, qtype), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(dtype or weight.dtype)


def _is_quantizable(weight: object) -> bool:
    return isinstance(weight, torch.Tensor) and weight.numel() > 0 and weight.shape[1] % _GROUP == 0


@dataclass
class AtLoadResult:
    """What ``quantize_at_load`` did, for the log and ``/health``."""

    method: str
    is_packed: bool
    is_int8_activations: bool = False
    num_tensors: int = 0
    num_bytes: int = 0  # packed (or, dequantised, the dense bytes they stand for)
    num_dense_bytes: int = 0  # the same tensors at the compute dtype

    def describe(self, level: str, dtype_name: str) -> str:
        """E.g. ``int4 at load (Q4_1 packed int4, lm_head Q8_0, avx2), bfloat16 elsewhere``."""
        layer_type = AT_LOAD_TYPES[self.method].name
        if not self.is_packed:
            return (
                f"{self.method} at load ({layer_type}, lm_head {LM_HEAD_TYPE.name}) dequantised "
                f"to {dtype_name}: no packed kernels on this path"
            )
        codes = "int8" if self.method == "int8" else "int4"
        activations = ", int8 activations" if self.is_int8_activations else ""
        return (
            f"{self.method} at load ({layer_type} packed {codes}, lm_head {LM_HEAD_TYPE.name}, "
            f"{level}{activations}), {dtype_name} elsewhere"
        )


def quantize_at_load(
    model: LlamaForCausalLM, method: str, is_int8_activations: bool = False
) -> AtLoadResult:
    """Quantise the loaded dense ``model``'s layer matmuls (``AT_LOAD_TYPES[method]``) and
    lm_head (Q8_0): packed linears where the CPU kernels take them (their inputs quantised to
    int8 per group with ``is_int8_activations``, as for GGUF), else the dequantised values in
    place. Call after the weights are assigned and before ``finalize``."""
    qtype = AT_LOAD_TYPES[method]
    kernels: ModuleType | None = model.decoder_ops.module
    is_packed = model.device.type == "cpu" and kernels_can_pack(kernels)
    result = AtLoadResult(method, is_packed, is_packed and is_int8_activations)
    with torch.no_grad():
        for layer in model.layers:
            linears: dict[str, PackedLinear] = {}
            for name, (weight_attr, bias_attr) in DENSE_PARAMS.items():
                weight = getattr(layer, weight_attr, None)
                if name in layer.replaced or not _is_quantizable(weight):
                    continue  # experts, or rows that are not whole groups: dense
                result.num_tensors += 1
                result.num_dense_bytes += weight.numel() * weight.element_size()
                if not is_packed:
                    weight.copy_(round_trip(weight, qtype))
                    continue
                packed = quantize_matrix(weight, qtype)
                result.num_bytes += packed.num_bytes
                bias = getattr(layer, bias_attr, None)
                linears[name] = PackedLinear(packed, bias, kernels, is_int8_activations)
            layer.replace_linears(linears)  # type: ignore[arg-type]
        head = model.lm_head
        if _is_quantizable(head):
            result.num_tensors += 1
            result.num_dense_bytes += head.numel() * head.element_size()
            if is_packed:
                packed = quantize_matrix(head, LM_HEAD_TYPE)
                result.num_bytes += packed.num_bytes
                model.replace_lm_head(PackedLinear(packed, None, kernels, is_int8_activations))
            else:  # float32 values, as the packed lm_head computes (a tied embedding stays)
                model.replace_lm_head(Linear(round_trip(head, LM_HEAD_TYPE, torch.float32), None))
    return result
