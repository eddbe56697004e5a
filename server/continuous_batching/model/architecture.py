"""Architecture description of a decoder-only model, as the forward pass needs it.

Each family's reader (``families``) fills it from a Hugging Face ``config.json``; the GGUF
reader from a file's metadata. Only the fields the forward pass needs are kept.

transformers 5 writes RoPE settings as ``rope_parameters = {rope_theta, rope_type, ...}``;
older configs write ``rope_theta`` plus an optional ``rope_scaling = {rope_type | type,
factor, ...}``. ``read_rope`` reads both into the same two fields (``rope_theta`` and
``rope_scaling``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: RoPE variants the rotary module implements ("default" is stored as ``rope_scaling=None``).
SUPPORTED_ROPE_TYPES: tuple[str, ...] = (
    "default",
    "linear",
    "llama3",
    "yarn",
    "longrope",
    "dynamic",
)

#: Older names of RoPE types (Phi-3's first configs say "su" for longrope).
_ROPE_TYPE_ALIASES: dict[str, str] = {"su": "longrope"}


class UnsupportedModelError(ValueError):
    """The checkpoint is not a model this engine can run (the message names what is not)."""


@dataclass
class ModelArchConfig:
    """Shapes and constants of a decoder-only model (llama and the families built on it)."""

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
    #: Which decoder block runs it (``layer_classes.LAYER_CLASSES``); set by the family's
    #: config reader (``families``).
    family: str = "llama"
    #: Attention window in tokens of the layers whose ``layer_types`` entry is
    #: "sliding_attention" (every layer when ``layer_types`` is empty); None: full attention.
    sliding_window: int | None = None
    #: Per layer "full_attention" or "sliding_attention" (transformers' ``layer_types``);
    #: empty: every layer alike.
    layer_types: tuple[str, ...] = ()
    #: Attention score scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5).
    attention_scale: float | None = None
    #: Attention logits become ``cap * tanh(logits / cap)`` before the mask (Gemma 2); None: off.
    attn_logit_softcap: float | None = None
    #: Output logits become ``cap * tanh(logits / cap)`` (Gemma 2); None: off.
    final_logit_softcap: float | None = None
    #: RoPE base and scaling of the "sliding_attention" layers when they differ from the
    #: others' (``rope_theta``/``rope_scaling``): Gemma 3's local rope. None: one rope for all.
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    #: Share of each head's dimensions that RoPE rotates (the first ones; Phi-4-mini: 0.75).
    partial_rotary_factor: float = 1.0
    #: Mixture of experts (``moe``): routed experts per MoE layer (0: a dense model).
    num_experts: int = 0
    #: Experts each token is routed to (top-k).
    num_experts_per_tok: int = 0
    #: Width of one expert's MLP (Qwen3-MoE's ``moe_intermediate_size``; Mixtral's experts
    #: use ``intermediate_size``).
    moe_intermediate_size: int = 0
    #: Renormalise the top-k routing weights to sum to 1 (Mixtral always does).
    is_norm_topk_prob: bool = True
    #: Every ``decoder_sparse_step``-th layer is MoE (Qwen3-MoE), except ``mlp_only_layers``.
    decoder_sparse_step: int = 1
    #: Layers that keep a dense MLP in a MoE model (Qwen3-MoE's ``mlp_only_layers``).
    mlp_only_layers: tuple[int, ...] = ()

    def window_of(self, layer_index: int) -> int | None:
        """The attention window of layer ``layer_index`` in tokens (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer_index] != "sliding_attention":
            return None
        return self.sliding_window

    def is_moe_layer(self, layer_index: int) -> bool:
        """True when layer ``layer_index`` runs routed experts rather than a dense MLP (the
        rule of transformers' Qwen3-MoE decoder layer; every layer of a Mixtral)."""
        if self.num_experts <= 0 or layer_index in self.mlp_only_layers:
            return False
        return (layer_index + 1) % self.decoder_sparse_step == 0

    @property
    def q_size(self) -> int:
        """Width of the query projection (all heads)."""
        return self.num_attention_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (``head_dim`` unless partial)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection (all kv heads)."""
        return self.num_key_value_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """About how many weights the model has (matmuls and embedding tables; norms and
        biases left out): every expert of an MoE layer counted."""
        h = self.hidden_size
        attention = h * (2 * self.q_size + 2 * self.kv_size)
        expert_width = self.moe_intermediate_size or self.intermediate_size
        total = 0
        for i in range(self.num_hidden_layers):
            mlp_width = self.num_experts * expert_width if self.is_moe_layer(i) else 0
            total += attention + 3 * h * (mlp_width or self.intermediate_size)
        tables = 1 if self.tie_word_embeddings else 2
        return total + tables * self.vocab_size * h


def read_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
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
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope type {rope_type!r}: supported {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    scaling["rope_type"] = rope_type
    if "original_max_position_embeddings" in d:
        # Phi-3 keeps it beside rope_scaling; longrope and yarn read it from there.
        scaling.setdefault(
            "original_max_position_embeddings", d["original_max_position_embeddings"]
        )
    return theta, scaling
