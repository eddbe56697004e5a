"""Llama, Mistral and Qwen2: one block, told apart by their biases and attention windows.

Sliding windows follow transformers: Mistral's ``sliding_window`` (null: full attention)
applies to every layer; Qwen2's only with ``use_sliding_window``, and then to the layers its
``layer_types`` name "sliding_attention" (by default layers ``max_window_layers`` and up).
Llama has no window.
"""

from __future__ import annotations

from typing import Any

from ..architecture import ModelArchConfig, UnsupportedModelError, read_rope

#: Hugging Face architecture -> the model_type it implies when config.json omits one.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


def read_config(d: dict[str, Any]) -> ModelArchConfig:
    """ModelArchConfig of a llama, mistral or qwen2 ``config.json``. Qwen2 differs only by
    q/k/v biases without an o_proj bias."""
    arch = d["architectures"][0]
    hidden_act = d.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {hidden_act!r}: only 'silu'")
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    qwen2 = ARCHITECTURES[arch] == "qwen2"
    attention_bias = True if qwen2 else bool(d.get("attention_bias", False))
    rope_theta, rope_scaling = read_rope(d)
    sliding_window, layer_types = _read_window(d, ARCHITECTURES[arch])
    return ModelArchConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        hidden_act=hidden_act,
        o_proj_bias=attention_bias and not qwen2,
        architecture=arch,
        model_type=d.get("model_type") or ARCHITECTURES[arch],
        sliding_window=sliding_window,
        layer_types=layer_types,
    )


def _read_window(d: dict[str, Any], family: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as transformers' Mistral and Qwen2 configs derive them."""
    window = d.get("sliding_window")
    if family == "llama" or window is None:
        return None, ()
    if family == "mistral":
        return int(window), ()
    # Qwen2Config: the window only with use_sliding_window; layers below max_window_layers
    # keep full attention unless config.json lists layer_types itself.
    if not d.get("use_sliding_window"):
        return None, ()
    num_layers = int(d["num_hidden_layers"])
    layer_types = d.get("layer_types")
    if layer_types is None:
        first = int(d.get("max_window_layers", 28))
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    if len(layer_types) != num_layers or not set(layer_types) <= _LAYER_TYPES:
        raise UnsupportedModelError(f"unsupported layer_types {layer_types!r}")
    return int(window), tuple(layer_types)


_LAYER_TYPES = {"full_attention", "sliding_attention"}
