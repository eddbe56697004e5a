"""GGUF matmul weights kept quantised on a CPU: each layer's quantised q/k/v, o, gate/up and
down tensors (and a quantised lm_head) become ``PackedLinear``s (``quantization.packed_gguf``
layout, ``cpu_kernels`` ``quant_linear`` kernel) installed with ``replace_linears``, so a
Q4_K_M file runs at about its own size in memory instead of the compute dtype's.

* q and k rows are un-permuted (llama.cpp's RoPE order, ``weights_gguf.unpermute_rope_rows``)
  on the packed rows: every scale and code belongs to one row, so permuting rows is exact;
* a fused matmul (q/k/v, gate/up) becomes one packed weight when its parts' types agree,
  else a ``ConcatLinear`` of one packed linear per run of neighbouring parts of one type
  (Q4_K_M's q and k stacked, beside its Q6_K v);
* the packed, stacked weights are written to the on-disk cache (``packed_cache``) at the first
  load and memory-mapped at later ones: nothing is repacked or copied then;
* a fused matmul with any part of a type that does not pack (F16, F32, BF16, other quants)
  stays dense: its tensors go through the dequantising path like before;
* the lm_head follows the file's own type (``output.weight``, or the tied
  ``token_embd.weight``); the embedding table of a packable type stays packed too (each step
  dequantises its tokens' rows: ``LlamaForCausalLM.replace_embedding``), the tied lm_head's
  weight serving as it.

The loader's ``gguf_dequantize_at_load`` (or a CPU path without the kernels) keeps the plain
dequantise-everything path, which the tests compare this one with.
"""

from __future__ import annotations

from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch
from gguf.quants import dequantize

from ..quantization.packed_cache import PackedCache
from ..quantization.packed_gguf import PACKABLE_TYPES, PackedWeight, concat_rows, repack
from ..quantization.packed_linear import ConcatLinear, PackedLinear
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
_CODE_WORDS = {4: "int4", 5: "int5", 6: "int6", 8: "int8"}


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
    #: Packed matmuls whose rows were tiled for the lane kernels (``lane_tiles``).
    is_lane_tiled: bool = False
    #: Where the packed weights came from: repacked, or the on-disk cache (``packed_cache``).
    origin: str = "repacked"

    def add(self, names: list[str], linear: PackedLinear) -> None:
        """Record source tensors ``names`` (of one type) packed as ``linear``'s weight."""
        weight, is_int8 = linear.weight, linear.is_int8
        self.consumed.update(names)
        self.num_tensors[weight.source] += len(names)
        self.code_bits.add(weight.bits)
        self.num_bytes += weight.num_bytes
        self.is_int8_activations |= is_int8
        self.is_lane_tiled |= weight.is_lane_tiled

    def describe(self, level: str) -> str:
        """E.g. ``gguf Q4_K, Q6_K (packed int4/int8, avx2, int8 activations)``, ending
        ``, 16-row tiles`` where the rows were tiled (AVX512-VNNI, AVX2); ``level``: the kernels'
        ISA."""
        if not self.num_tensors:
            return "gguf (no tensor of a packable type: dense)"
        types = ", ".join(t for t, _ in self.num_tensors.most_common())
        codes = "/".join(_CODE_WORDS[b] for b in sorted(self.code_bits))
        activations = ", int8 activations" if self.is_int8_activations else ""
        tiles = ", 16-row tiles" if self.is_lane_tiled else ""
        return f"gguf {types} (packed {codes}, {level}{activations}{tiles})"


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


def packed_weight_of(tensor: GGUFTensor, config: ModelArchConfig) -> PackedWeight:
    """One quantised GGUF matrix repacked, its q/k rows back in Hugging Face order."""
    weight = repack(np.asarray(tensor.data), tensor.tensor_type)
    heads = _rope_heads(tensor.name, config)
    if heads is not None:
        order = unpermute_rope_rows(torch.arange(weight.num_rows), heads)
        weight = weight.select_rows(order)
    return weight


def _dense_bias(tensor: GGUFTensor | None, config: ModelArchConfig) -> torch.Tensor | None:
    """A bias vector as float32 (un-permuted for q and k), or None."""
    if tensor is None:
        return None
    bias = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), np.float32))
    heads = _rope_heads(tensor.name, config)
    return bias if heads is None else unpermute_rope_rows(bias, heads)


@dataclass(frozen=True)
class PackedMatmul:
    """One matmul kept packed: ``key`` names it (``blk.3.gate_up``, ``lm_head``), ``names`` its
    GGUF tensors in output order, ``runs`` which of them are stacked into one packed weight
    (neighbours of one type: every part of a fused matmul has the same K, so one type is one
    layout)."""

    key: str
    layer: int | None
    fused: str
    names: list[str]
    runs: list[list[int]]

    def weight_key(self, run: int) -> str:
        """The cache name of run ``run``'s stacked weight."""
        return f"{self.key}.{run}"


def packed_matmuls(model: LlamaForCausalLM, tensors: dict[str, GGUFTensor]) -> list[PackedMatmul]:
    """The matmuls that go packed: each fused matmul whose parts all have packable types, and
    the lm_head when its tensor's type is."""
    matmuls = []
    for i in range(len(model.layers)):
        for fused, parts in GGUF_FUSED.items():
            names = [f"blk.{i}.{part}.weight" for part in parts]
            # A dense or differently named part (Phi-3's attn_qkv, experts): the whole matmul
            # stays on the dense path.
            if all(n in tensors and tensors[n].tensor_type in PACKABLE_TYPES for n in names):
                runs = _runs([tensors[n].tensor_type for n in names])
                matmuls.append(PackedMatmul(f"blk.{i}.{fused}", i, fused, names, runs))
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    if tensors[head].tensor_type in PACKABLE_TYPES:
        matmuls.append(PackedMatmul("lm_head", None, "lm_head", [head], [[0]]))
    embedding = tensors["token_embd.weight"]
    if head != embedding.name and embedding.tensor_type in PACKABLE_TYPES:
        # Untied: the table has an entry of its own (tied, the lm_head's weight serves).
        matmuls.append(PackedMatmul("embedding", None, "embedding", [embedding.name], [[0]]))
    return matmuls


def _runs(types: list[object]) -> list[list[int]]:
    """Indices grouped into runs of neighbours of one type."""
    runs: list[list[int]] = []
    for i, kind in enumerate(types):
        if runs and types[runs[-1][0]] == kind:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def stacked_weight(
    matmul: PackedMatmul, run: int, tensors: dict[str, GGUFTensor], config: ModelArchConfig
) -> PackedWeight:
    """Run ``run`` of ``matmul``: its tensors repacked, their rows stacked."""
    parts = [packed_weight_of(tensors[matmul.names[i]], config) for i in matmul.runs[run]]
    return parts[0] if len(parts) == 1 else concat_rows(parts)


def _fill_cache(
    cache: PackedCache,
    matmuls: list[PackedMatmul],
    tensors: dict[str, GGUFTensor],
    config: ModelArchConfig,
) -> None:
    """Repack every matmul's weights into a new cache entry, each written then dropped (a few
    in flight: numpy's array ops release the GIL, so one thread per core repacks)."""
    # Q6_K grows most (210 -> 276 bytes per 256 weights): a bound for the disk check.
    num_bytes = sum(tensors[n].data.nbytes for m in matmuls for n in m.names) * 4 // 3
    if not cache.begin(num_bytes):
        return
    num_workers = max(1, torch.get_num_threads())
    with ThreadPoolExecutor(num_workers) as pool:
        pending = deque[tuple[str, Future[PackedWeight]]]()
        for matmul in matmuls:
            for run in range(len(matmul.runs)):
                job = pool.submit(stacked_weight, matmul, run, tensors, config)
                pending.append((matmul.weight_key(run), job))
                if len(pending) > num_workers:
                    key, done = pending.popleft()
                    cache.put(key, done.result())
        for key, done in pending:
            cache.put(key, done.result())
    cache.commit()


def install_packed_linears(
    model: LlamaForCausalLM,
    reader: GGUFFile,
    config: ModelArchConfig,
    kernels: ModuleType,
    is_int8_activations: bool = False,
    cache: PackedCache | None = None,
) -> PackedLoad:
    """Replace the model's matmuls whose GGUF tensors are all of packable types by packed
    linears (and the lm_head, when its tensor is); returns what was consumed.

    With ``cache``, the packed (and stacked) weights are mapped from it; on a miss they are
    repacked into it first, one matmul at a time, then mapped (where it cannot be written,
    they are repacked into memory)."""
    tensors = {t.name: t for t in reader.tensors}
    load = PackedLoad()
    matmuls = packed_matmuls(model, tensors)
    if cache is not None and cache.is_hit:
        load.origin = "mapped from the cache"
    elif cache is not None and matmuls:
        _fill_cache(cache, matmuls, tensors, config)
        load.origin = "repacked into the cache" if cache.is_hit else "repacked (not cached)"
    layers: list[dict[str, PackedLinear | ConcatLinear]] = [{} for _ in model.layers]
    embedding: PackedWeight | None = None
    for matmul in matmuls:
        linears = []
        bias_names = [n.removesuffix(".weight") + ".bias" for n in matmul.names]
        biases = [_dense_bias(tensors.get(b), config) for b in bias_names]
        if any(b is not None for b in biases):
            # In a group where some part has a bias, the others get zeros.
            biases = [
                torch.zeros(tensors[n].shape[1]) if b is None else b
                for n, b in zip(matmul.names, biases, strict=True)
            ]
        for j, run in enumerate(matmul.runs):
            weight = None if cache is None else cache.get(matmul.weight_key(j))
            if weight is None:
                weight = stacked_weight(matmul, j, tensors, config)
            if matmul.fused == "embedding":
                embedding = weight
                break
            bias = None if biases[run[0]] is None else torch.cat([biases[i] for i in run])
            linears.append(PackedLinear(weight, bias, kernels, is_int8_activations))
            load.add([matmul.names[i] for i in run], linears[-1])
        if not linears:
            continue  # the embedding: installed last, once the lm_head is
        load.consumed.update(b for b in bias_names if b in tensors)
        linear = linears[0] if len(linears) == 1 else ConcatLinear(linears)
        if matmul.layer is None:
            model.replace_lm_head(linear)
        else:
            layers[matmul.layer][matmul.fused] = linear
    for layer, linears_of_layer in zip(model.layers, layers, strict=True):
        layer.replace_linears(linears_of_layer)  # type: ignore[arg-type]
    if model.is_lm_head_replaced and config.tie_word_embeddings:
        embedding = model.lm_head_linear.weight  # type: ignore[attr-defined]
    if embedding is not None:
        model.replace_embedding(embedding)
        load.consumed.add("token_embd.weight")
    else:
        load.consumed.discard("token_embd.weight")  # the dense table gets its rows
    return load
