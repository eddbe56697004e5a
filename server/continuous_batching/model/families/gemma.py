"""Gemma 2 and Gemma 3 (text): the llama block with (1 + w) RMSNorms, norms after attention
and after the MLP, GeGLU, scaled embeddings and queries, soft-capped logits; Gemma 3 adds
q/k norms and a separate RoPE base for its sliding-window layers (``model.gemma``)."""

from __future__ import annotations

from typing import Any

from ..architecture import ModelArchConfig, UnsupportedModelError, read_rope

#: Hugging Face architecture -> the model_type it implies when config.json omits one.
ARCHITECTURES: dict[str, str] = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
#: Multimodal checkpoints whose text part alone is not served (their tensors live under other
#: names, beside a vision tower): the reader says so instead of "unsupported architecture".
MULTIMODAL_ARCHITECTURES: tuple[str, ...] = ("Gemma3ForConditionalGeneration",)
#: GeGLU activations Gemma configs name (all mean the tanh approximation of GELU).
GELU_TANH_NAMES: tuple[str, ...] = ("gelu_pytorch_tanh",)
#: transformers' defaults of Gemma 3's two RoPE bases (``Gemma3TextConfig.default_theta``).
GEMMA3_GLOBAL_THETA = 1_000_000.0
GEMMA3_LOCAL_THETA = 10_000.0


def read_config(d: dict[str, Any]) -> ModelArchConfig:
    """ModelArchConfig of a Gemma 2 or Gemma 3 text ``config.json``."""
    arch = d["architectures"][0]
    if arch in MULTIMODAL_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{arch} (text and vision) is not supported: serve a text-only Gemma3ForCausalLM "
            "checkpoint (model_type gemma3_text)"
        )
    model_type = d.get("model_type") or ARCHITECTURES[arch]
    act = d.get("hidden_activation") or d.get("hidden_act") or GELU_TANH_NAMES[0]
    if act not in GELU_TANH_NAMES:
        raise UnsupportedModelError(f"unsupported Gemma activation {act!r}: only {GELU_TANH_NAMES}")
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional (encoder) Gemma attention is not supported")
    heads, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
    num_layers = int(d["num_hidden_layers"])
    if ARCHITECTURES[arch] == "gemma2":
        (rope_theta, rope_scaling), sliding_rope = read_rope(d), None
        pattern = 2
    else:
        (rope_theta, rope_scaling), sliding_rope = _gemma3_ropes(d)
        pattern = int(d.get("sliding_window_pattern", 6))
    layer_types = tuple(d.get("layer_types") or _layer_types(num_layers, pattern))
    window = d.get("sliding_window")
    return ModelArchConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        attention_bias=bool(d.get("attention_bias", False)),
        hidden_act=act,
        o_proj_bias=bool(d.get("attention_bias", False)),
        architecture=arch,
        model_type=model_type,
        family=ARCHITECTURES[arch],
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        attention_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_logit_softcap=_cap(d.get("attn_logit_softcapping")),
        final_logit_softcap=_cap(d.get("final_logit_softcapping")),
        sliding_rope_theta=sliding_rope[0] if sliding_rope else None,
        sliding_rope_scaling=sliding_rope[1] if sliding_rope else None,
    )


def _cap(value: Any) -> float | None:
    """A soft-capping constant, None when off (absent, null or 0)."""
    return float(value) if value else None


def _layer_types(num_layers: int, pattern: int) -> list[str]:
    """transformers' default: every ``pattern``-th layer full attention, the others sliding."""
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]


RopeSetting = tuple[float, dict[str, Any] | None]


def _gemma3_ropes(d: dict[str, Any]) -> tuple[RopeSetting, RopeSetting]:
    """(global rope, local rope) of a Gemma 3 config: transformers 5 nests ``rope_parameters``
    by layer type; older configs write rope_theta / rope_scaling (global layers only) and
    rope_local_base_freq."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full_params = params["full_attention"]
        full = read_rope({"rope_theta": GEMMA3_GLOBAL_THETA, "rope_parameters": full_params})
        local = params.get("sliding_attention") or {}
        sliding = read_rope({"rope_theta": GEMMA3_LOCAL_THETA, "rope_parameters": local})
        return full, sliding
    full = read_rope({"rope_theta": GEMMA3_GLOBAL_THETA, **d})
    return full, (float(d.get("rope_local_base_freq", GEMMA3_LOCAL_THETA)), None)
