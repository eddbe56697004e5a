"""GGUF matmul weights kept quantised on a CPU: each layer's quantised q/k/v, o, gate/up and
down tensors (and a quantised lm_head) become ``PackedLinear``s (``quantization.packed_gguf``
layout, ``cpu_kernels`` ``quant_linear`` kernel) installed with ``replace_linears``, so a
Q4_K_M file runs at about its own size in memory instead of the compute dtype's.

* q and k rows are un-permuted (llama.cpp's RoPE order, ``weights_gguf.unpermute_rope_rows``)
  on the packed rows: every scale and code belongs to one row, so permuting rows is exact;
* a fused matmul (q/k/v, gate/up) becomes one packed weight when its parts' layouts agree,
  else a ``ConcatLinear`` of one packed linear per part (Q4_K_M mixes Q4_K and Q6_K);
* a fused matmul with any part of a type that does not pack (F16, F32, BF16, other quants)
  stays dense: its tensors go through the dequantising path like before;
* the embedding stays dense (a gather: its rows are dequantised at load); the lm_head follows
  the file's own type (``output.weight``, or the tied ``token_embd.weight``).

The loader's ``gguf_dequantize_at_load`` (or a CPU path without the kernels) keeps the plain
dequantise-everything path, which the tests compare this one with.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch
from gguf.quants import dequantize

from ..quantization.packed_cache import PackedCache
from ..quantization.packed_gguf import PACKABLE_TYPES, PackedWeight, repack
from ..quantization.packed_linear import ConcatLinear, PackedLinear, fused_packed_linear
from .architecture import ModelArchConfig
from .gguf_file import GGUFFile, GGUFTensor
from .llama import LlamaForCausalLM
from .weights_gguf import has_permuted_rope_rows, unpermute_rope_rows

#: Our fused matmuls -> the GGUF tensors they hold, in output order.
GGUF_FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}
_CODE_WORDS = {4: "int4", 8: "int8"}


@dataclass
class PackedLoad:
    """What ``install_packed_linears`` did: the GGUF tensors it consumed (the dense loader
    skips them) and, per source type, how many tensors and bytes are held packed."""

    consumed: set[str] = field(default_factory=set)
    num_tensors: Counter[str] = field(default_factory=Counter)
    code_bits: set[int] = field(default_factory=set)
    num_bytes: int = 0
    #: Packed matmuls that quantise their input to int8 (``PackedLinear.is_int8``).
    is_int8_activations: bool = False
    #: The packed weights were read from the on-disk cache (``packed_cache``), not repacked.
    is_cached: bool = False

    def add(self, name: str, weight: PackedWeight, linear: PackedLinear | ConcatLinear) -> None:
        """Record one source tensor packed as ``weight``, run by ``linear``."""
        self.consumed.add(name)
        self.num_tensors[weight.source] += 1
        self.code_bits.add(weight.bits)
        self.num_bytes += weight.num_bytes
        parts = linear.parts if isinstance(linear, ConcatLinear) else [linear]
        self.is_int8_activations |= any(part.is_int8 for part in parts)

    def describe(self, level: str) -> str:
        """E.g. ``gguf Q4_K, Q6_K (packed int4/int8, avx2, int8 activations)``; ``level``: the
        kernels' ISA."""
        if not self.num_tensors:
            return "gguf (no tensor of a packable type: dense)"
        types = ", ".join(t for t, _ in self.num_tensors.most_common())
        codes = "/".join(_CODE_WORDS[b] for b in sorted(self.code_bits))
        activations = ", int8 activations" if self.is_int8_activations else ""
        return f"gguf {types} (packed {codes}, {level}{activations})"


def _rope_heads(name: str, config: ModelArchConfig) -> int | None:
    """The heads whose rows llama.cpp permuted in tensor ``name`` (None: not q or k, or an
    architecture whose q/k rows the converter leaves alone)."""
    if not has_permuted_rope_rows(config):
        return None
    if ".attn_q." in name:
        return config.num_attention_heads
    if ".attn_k." in name:
        return config.num_key_value_heads
    return None


def packed_weight_of(
    tensor: GGUFTensor, config: ModelArchConfig, cache: PackedCache | None = None
) -> PackedWeight:
    """One quantised GGUF matrix repacked, its q/k rows back in Hugging Face order (from
    ``cache`` where it holds the tensor; else repacked, and handed to ``cache``)."""
    weight = None if cache is None else cache.get(tensor.name)
    if weight is not None:
        return weight
    weight = repack(np.asarray(tensor.data), tensor.tensor_type)
    heads = _rope_heads(tensor.name, config)
    if heads is not None:
        order = unpermute_rope_rows(torch.arange(weight.num_rows), heads)
        weight = weight.select_rows(order)
    if cache is not None:
        cache.put(tensor.name, weight)
    return weight


def _dense_bias(tensor: GGUFTensor | None, config: ModelArchConfig) -> torch.Tensor | None:
    """A bias vector as float32 (un-permuted for q and k), or None."""
    if tensor is None:
        return None
    bias = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), np.float32))
    heads = _rope_heads(tensor.name, config)
    return bias if heads is None else unpermute_rope_rows(bias, heads)


def install_packed_linears(
    model: LlamaForCausalLM,
    reader: GGUFFile,
    config: ModelArchConfig,
    kernels: ModuleType,
    is_int8_activations: bool = False,
    cache: PackedCache | None = None,
) -> PackedLoad:
    """Replace the model's matmuls whose GGUF tensors are all of packable types by packed
    linears (and the lm_head, when its tensor is); returns what was consumed. With ``cache``,
    weights it holds are read from it and the others repacked and written to it."""
    tensors = {t.name: t for t in reader.tensors}
    load = PackedLoad()
    for i, layer in enumerate(model.layers):
        linears: dict[str, PackedLinear | ConcatLinear] = {}
        for fused, parts in GGUF_FUSED.items():
            names = [f"blk.{i}.{part}.weight" for part in parts]
            if not all(n in tensors and tensors[n].tensor_type in PACKABLE_TYPES for n in names):
                # A dense or differently named part (Phi-3's attn_qkv, experts): the whole
                # matmul stays on the dense path.
                continue
            weights = [packed_weight_of(tensors[n], config, cache) for n in names]
            bias_names = [f"blk.{i}.{part}.bias" for part in parts]
            biases = [_dense_bias(tensors.get(b), config) for b in bias_names]
            linears[fused] = fused_packed_linear(weights, biases, kernels, is_int8_activations)
            for name, weight in zip(names, weights, strict=True):
                load.add(name, weight, linears[fused])
            load.consumed.update(b for b in bias_names if b in tensors)
        layer.replace_linears(linears)  # type: ignore[arg-type]
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    head = tensors[head_name]
    if head.tensor_type in PACKABLE_TYPES:
        weight = packed_weight_of(head, config, cache)
        head_linear = PackedLinear(weight, None, kernels, is_int8_activations)
        model.replace_lm_head(head_linear)
        load.add(head_name, weight, head_linear)
        if head_name == "token_embd.weight":
            load.consumed.discard(head_name)  # tied: the embedding still needs its rows
    if cache is not None:
        load.is_cached = cache.is_hit
        cache.commit()
    return load
