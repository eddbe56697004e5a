"""Architecture description of a llama-family model, read from a Hugging Face ``config.json``.

Only the fields the forward pass needs are kept. transformers 5 writes RoPE settings as
``rope_parameters = {rope_theta, rope_type, ...}``; older configs write ``rope_theta`` plus an
optional ``rope_scaling = {rope_type | type, factor, ...}``. Both are read into the same two
fields (``rope_theta`` and ``rope_scaling``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Architectures whose checkpoints map onto our llama module unchanged (same tensor names, same
#: math). Qwen2 differs only by q/k/v biases without an o_proj bias, which the config covers.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

#: RoPE variants the rotary module implements ("default" is stored as ``rope_scaling=None``).
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a llama-family model this engine can run."""


@dataclass
class ModelArchConfig:
    """Shapes and constants of a llama-family decoder-only model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool = False
    hidden_act: str = "silu"
    #: Bias on o_proj. Llama's ``attention_bias`` covers q/k/v/o; Qwen2 has q/k/v bias only.
    o_proj_bias: bool = False
    architecture: str = "LlamaForCausalLM"
    #: The checkpoint's ``model_type`` (config.json; "llama" for a llama GGUF).
    model_type: str = "llama"

    @property
    def q_size(self) -> int:
        """Width of the query projection (all heads)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection (all kv heads)."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelArchConfig:
        """Build from a parsed ``config.json``; raise UnsupportedModelError for other families."""
        architectures = d.get("architectures") or []
        arch = architectures[0] if architectures else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model architecture {arch!r} (model_type {d.get('model_type')!r}): "
                f"the continuous-batching engine runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {hidden_act!r}: only 'silu'")
        if d.get("use_sliding_window") and d.get("sliding_window"):
            raise UnsupportedModelError("sliding-window attention is not supported")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        qwen2 = SUPPORTED_ARCHITECTURES[arch] == "qwen2"
        attention_bias = True if qwen2 else bool(d.get("attention_bias", False))
        rope_theta, rope_scaling = _read_rope(d)
        return cls(
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
            model_type=d.get("model_type") or SUPPORTED_ARCHITECTURES[arch],
        )


def _read_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, rope_scaling or None) from either config generation."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling: dict[str, Any] | None = dict(params)
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else None
    if scaling is None:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope type {rope_type!r}: supported {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    scaling["rope_type"] = rope_type
    return theta, scaling
