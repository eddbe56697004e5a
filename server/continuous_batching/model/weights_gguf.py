"""Read llama.cpp GGUF files directly: metadata -> ``ModelArchConfig``, tensors -> dequantised
float32 tensors under Hugging Face names (the ``(hf_name, tensor)`` source ``assign_weights``
takes).

Two things differ from a Hugging Face checkpoint besides the names:

* llama.cpp's converter permutes the rows of q and k (and their biases) per head, from the
  Hugging Face "rotate half" RoPE layout to the interleaved-pairs layout its kernels use; we
  undo that permutation (the same reshape transformers' GGUF loader applies);
* GGUF stores matrices in GGML order ([in, out] in its shape field), but the ``gguf`` package's
  ``dequantize`` returns numpy arrays in row-major [out, in], the ``nn.Linear`` layout.

Quantised tensors (Q4_1, Q8_0, K-quants...) are dequantised at load with ``gguf.quants`` on
this path: the model then runs in the configured dtype, at a dense checkpoint's memory. On a
CPU with the fused kernels, ``weights_gguf_packed`` keeps the quantised matmul weights packed
instead and this path loads the rest.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from . import gguf_families
from .architecture import ModelArchConfig, UnsupportedModelError
from .gguf_file import GGUFFile
from .weights_gguf_gemma import GEMMA_GGUF, with_gguf_gemma
from .weights_gguf_moe import (
    GGUF_MOE_ARCHITECTURES,
    MOE_LAYER_NAMES,
    PERMUTED_MOE_MODEL_TYPES,
    with_gguf_experts,
)

#: GGUF architectures whose tensors map onto our llama module (mistral GGUFs say "llama").
GGUF_ARCHITECTURES: tuple[str, ...] = (
    "llama",
    *gguf_families.GGUF_FAMILIES,
    *GGUF_MOE_ARCHITECTURES,
)

_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **gguf_families.LAYER_NAMES,
    **MOE_LAYER_NAMES,
}


def open_gguf(path: str | Path) -> GGUFFile:
    """Memory-map a GGUF file (tensor data is read when dequantised)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    return GGUFFile(path)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.value(key, default)


def read_gguf_config(reader: GGUFFile) -> ModelArchConfig:
    """Build the architecture config from the GGUF metadata and tensor list."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}: supported {list(GGUF_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        # Llama 3.1-style RoPE arrives as a frequency tensor without its parameters.
        raise UnsupportedModelError("GGUF with a rope_freqs tensor (llama3 RoPE) is not supported")

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata {arch}.{key} is missing")
        return value

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    context_length = int(meta("context_length", 2048))
    architecture, family = gguf_families.GGUF_FAMILIES.get(arch, ("LlamaForCausalLM", "llama"))
    config = ModelArchConfig(
        # GGML shapes are [in, out]: the embedding is [hidden, vocab].
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=gguf_families.rope_scaling(reader, arch, context_length),
        max_position_embeddings=context_length,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        architecture=architecture,
        model_type=arch,
        family=family,
        partial_rotary_factor=int(meta("rope.dimension_count", head_dim)) / head_dim,
        sliding_window=gguf_families.sliding_window(reader, arch, context_length),
    )

    def arch_meta(key: str, default: Any) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    if arch in GEMMA_GGUF:
        return with_gguf_gemma(config, arch, arch_meta)
    return with_gguf_experts(config, arch, arch_meta, tensors)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of architecture ``arch``, or None if it has
    none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_LAYER_NAMES, **gguf_families.ARCH_LAYER_NAMES.get(arch, {})}
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in names:
        return None
    return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head, its rows were reordered from
    [first half, second half] to interleaved pairs; ``weight`` is [heads * head_dim, ...]."""
    half = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape)


def has_permuted_rope_rows(config: ModelArchConfig) -> bool:
    """True when llama.cpp's converter permuted this model's q/k rows (``unpermute_rope_rows``
    undoes it). Mixtral's GGUF is a "llama" one (the permuted layout) read as "mixtral"."""
    return config.model_type in (*gguf_families.PERMUTED_ARCHITECTURES, *PERMUTED_MOE_MODEL_TYPES)


def iter_gguf(
    reader: GGUFFile, config: ModelArchConfig, skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, float32 tensor) for every tensor but those named in ``skip`` (GGUF
    names: kept quantised elsewhere), dequantised one at a time. Unknown tensor names are
    passed through unchanged so ``assign_weights`` reports them."""
    is_permuted = has_permuted_rope_rows(config)
    for tensor in reader.tensors:
        if tensor.name in skip:
            continue
        if tensor.name in gguf_families.CONFIG_TENSORS:
            continue  # LongRoPE factors: read into the config already
        values = dequantize(tensor.data, tensor.tensor_type)
        # Quantised tensors come back as fresh arrays; F32 ones as read-only memory maps.
        array = np.asarray(values, dtype=np.float32)
        weight = torch.from_numpy(array if array.flags.writeable else array.copy())
        name = hf_name(tensor.name, config.model_type) or tensor.name
        if is_permuted and ".attn_q." in tensor.name:
            weight = unpermute_rope_rows(weight, config.num_attention_heads)
        elif is_permuted and ".attn_k." in tensor.name:
            weight = unpermute_rope_rows(weight, config.num_key_value_heads)
        yield name, weight
