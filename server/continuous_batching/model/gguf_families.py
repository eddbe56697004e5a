"""What llama.cpp's GGUF files of the non-llama families add to ``weights_gguf``: their
architectures, tensor names and RoPE metadata (as llama.cpp's ``convert_hf_to_gguf.py``
writes them).

* qwen3: per-head ``attn_q_norm`` / ``attn_k_norm``; q and k rows are not permuted (llama.cpp
  runs Qwen with the "NeoX" rotate-half RoPE, our layout);
* phi3: fused ``attn_qkv`` and ``ffn_up`` holding gate and up (Phi-3's own fused tensors),
  unpermuted; LongRoPE as ``rope_factors_long`` / ``rope_factors_short`` tensors plus
  ``rope.scaling.attn_factor`` and ``rope.scaling.original_context_length``; a partial rotary
  factor as ``rope.dimension_count`` below the head size; ``attention.sliding_window`` (0: none);
* gemma2, gemma3: Gemma's norms, soft caps, sliding layers and attention scale
  (``weights_gguf_gemma``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .architecture import UnsupportedModelError
from .gguf_file import GGUFFile
from .weights_gguf_gemma import GEMMA_GGUF, GEMMA_LAYER_NAMES

#: GGUF architecture -> (Hugging Face architecture, our family) of the non-llama ones.
GGUF_FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    **{arch: (hf_arch, family) for arch, (hf_arch, family, *_) in GEMMA_GGUF.items()},
}

#: Per-layer GGUF names of these families that llama's table lacks (the rest are llama's).
LAYER_NAMES: dict[str, str] = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
}

#: Names that mean something else in one family, keyed by our ``model_type`` (the GGUF
#: architecture but for Gemma 3's "gemma3_text"): Phi-3's ``ffn_up`` is gate and up, Gemma's
#: ``ffn_norm`` the pre-feed-forward norm.
ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    **{family: GEMMA_LAYER_NAMES for _, family, *_ in GEMMA_GGUF.values()},
}

#: GGUF architectures whose q/k rows llama.cpp's converter permutes to interleaved pairs.
PERMUTED_ARCHITECTURES: tuple[str, ...] = ("llama",)

#: Global GGUF tensors that are configuration, read by ``rope_scaling`` (not weights).
CONFIG_TENSORS: tuple[str, ...] = ("rope_factors_long.weight", "rope_factors_short.weight")


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.value(key, default)


def rope_scaling(reader: GGUFFile, arch: str, context_length: int) -> dict[str, Any] | None:
    """The ``rope_scaling`` of a GGUF (None: plain RoPE): linear, yarn, or LongRoPE from the
    factor tensors; UnsupportedModelError for any other scaling type."""
    tensors = {t.name: t for t in reader.tensors}
    if "rope_factors_long.weight" in tensors:
        return _longrope(reader, arch, tensors, context_length)
    rope_type = str(_field(reader, f"{arch}.rope.scaling.type", "none"))
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if rope_type == "yarn":
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(original),
        }
    if rope_type != "none":
        raise UnsupportedModelError(f"unsupported GGUF rope scaling {rope_type!r}")
    return None


def _longrope(
    reader: GGUFFile, arch: str, tensors: dict[str, Any], context_length: int
) -> dict[str, Any]:
    """Phi-3's LongRoPE back from the two factor tensors and their metadata."""
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise UnsupportedModelError(f"GGUF metadata {arch}.rope.scaling.original_context_length")

    def factors(name: str) -> list[float]:
        return np.asarray(tensors[name].data, dtype=np.float32).reshape(-1).tolist()

    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "original_max_position_embeddings": int(original),
        "long_factor": factors("rope_factors_long.weight"),
        "short_factor": factors("rope_factors_short.weight"),
    }
    attn_factor = _field(reader, f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return scaling


def sliding_window(reader: GGUFFile, arch: str, context_length: int) -> int | None:
    """The attention window a GGUF names, when it binds (shorter than the context)."""
    window = _field(reader, f"{arch}.attention.sliding_window")
    return int(window) if window and int(window) < context_length else None
