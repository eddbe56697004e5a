"""Phi-3 / Phi-4-mini: the llama block with q/k/v and gate/up stored fused in the checkpoint
(``qkv_proj``, ``gate_up_proj``), LongRoPE scaling and a partial rotary factor (Phi-4-mini
rotates 3/4 of each head)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..architecture import ModelArchConfig
from . import llama

ARCHITECTURES: dict[str, str] = {"Phi3ForCausalLM": "phi3"}


def partial_rotary_factor(d: dict[str, Any]) -> float:
    """The share of each head RoPE rotates: top level (older configs) or in
    ``rope_parameters`` (transformers 5)."""
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    value = d.get("partial_rotary_factor") or params.get("partial_rotary_factor")
    return float(value) if value else 1.0


def read_config(d: dict[str, Any]) -> ModelArchConfig:
    """ModelArchConfig of a Phi-3 ``config.json`` (family "phi3": ``model.phi3``'s block).

    Phi-3 configs name a ``sliding_window`` (2047 for Phi-3-mini-4k): it is passed on in
    ``ModelArchConfig.sliding_window`` for the layers' attention when it is shorter than the
    context (a longer one never binds)."""
    as_llama = {**d, "architectures": ["LlamaForCausalLM"], "sliding_window": None}
    config = llama.read_config(as_llama)
    window = d.get("sliding_window")
    is_binding = window is not None and int(window) < config.max_position_embeddings
    return dataclasses.replace(
        config,
        architecture=d["architectures"][0],
        model_type=d.get("model_type") or "phi3",
        family="phi3",
        partial_rotary_factor=partial_rotary_factor(d),
        sliding_window=int(window) if is_binding else None,
    )
