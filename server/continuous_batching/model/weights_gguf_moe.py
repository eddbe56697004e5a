"""The mixture-of-experts part of a llama.cpp GGUF's architecture (``weights_gguf``).

llama.cpp's converter writes Mixtral as architecture "llama" with ``llama.expert_count`` and
``llama.expert_used_count``, and Qwen3-MoE as "qwen3moe" with ``expert_feed_forward_length``
too. Its MoE tensors per layer: the router ``ffn_gate_inp`` [E, H] and the stacked
``ffn_{gate,up,down}_exps`` (``moe_weights`` splits them per expert); Qwen3-MoE adds
``attn_q_norm``/``attn_k_norm``. llama.cpp's graphs for both renormalise the top-k weights
(Qwen3-MoE's ``norm_topk_prob`` is not in the file), so the config says so too. A layer
without a router runs a dense MLP (Qwen3-MoE's ``mlp_only_layers``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

from .architecture import ModelArchConfig, UnsupportedModelError

#: GGUF tensor kinds of the MoE families -> their Hugging Face name within a layer (the
#: stacked experts under ``mlp.experts.<kind>``, as ``moe_weights`` expects).
MOE_LAYER_NAMES: dict[str, str] = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}

#: GGUF architectures only MoE models use (Mixtral's is "llama").
GGUF_MOE_ARCHITECTURES: tuple[str, ...] = ("qwen3moe",)

#: Model types of MoE GGUFs whose q/k rows llama.cpp's converter permutes (its LlamaModel).
PERMUTED_MOE_MODEL_TYPES: tuple[str, ...] = ("mixtral",)

#: GGUF architecture (with experts) -> (family, HF architecture, model_type).
_FAMILIES: dict[str, tuple[str, str, str]] = {
    "llama": ("mixtral", "MixtralForCausalLM", "mixtral"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
}


def with_gguf_experts(
    config: ModelArchConfig,
    arch: str,
    meta: Callable[[str, Any], Any],
    tensor_names: Collection[str],
) -> ModelArchConfig:
    """``config`` (read as a llama) with the experts of GGUF architecture ``arch``;
    ``meta(key, default)`` reads ``{arch}.{key}``. Unchanged for a dense model."""
    num_experts = int(meta("expert_count", 0) or 0)
    if num_experts == 0:
        return config
    if arch not in _FAMILIES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} with experts is not supported")
    family, architecture, model_type = _FAMILIES[arch]
    routed = {
        i for i in range(config.num_hidden_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names
    }
    return dataclasses.replace(
        config,
        architecture=architecture,
        model_type=model_type,
        family=family,
        num_experts=num_experts,
        num_experts_per_tok=int(meta("expert_used_count", 0)),
        moe_intermediate_size=int(meta("expert_feed_forward_length", config.intermediate_size)),
        is_norm_topk_prob=True,
        mlp_only_layers=tuple(i for i in range(config.num_hidden_layers) if i not in routed),
    )
