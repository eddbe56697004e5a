"""Qwen3: the llama block plus an RMSNorm over each q and k head before RoPE (``q_norm`` and
``k_norm``, weights of ``head_dim``), without q/k/v bias unless ``attention_bias`` says so."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..architecture import ModelArchConfig, UnsupportedModelError
from . import llama

ARCHITECTURES: dict[str, str] = {"Qwen3ForCausalLM": "qwen3"}


def sliding_layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """Per layer attention kind of a Qwen3 config: its ``layer_types`` if given, else (as
    transformers' Qwen3Config) sliding from layer ``max_window_layers`` on when
    ``use_sliding_window`` is set."""
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    num_layers, first_sliding = int(d["num_hidden_layers"]), int(d.get("max_window_layers", 0))
    is_sliding = bool(d.get("use_sliding_window"))
    return tuple(
        "sliding_attention" if is_sliding and i >= first_sliding else "full_attention"
        for i in range(num_layers)
    )


def read_config(d: dict[str, Any]) -> ModelArchConfig:
    """ModelArchConfig of a Qwen3 ``config.json`` (family "qwen3": ``model.qwen3``'s block).

    Released Qwen3 checkpoints say ``use_sliding_window: false``. A config that turns it on
    is refused until the engine honours ``ModelArchConfig.window_of`` (the sliding-window
    work): ``sliding_layer_types`` already computes which layers it would concern."""
    is_sliding = d.get("use_sliding_window") and d.get("sliding_window")
    if is_sliding and "sliding_attention" in sliding_layer_types(d):
        raise UnsupportedModelError(
            "Qwen3 with use_sliding_window=true is not supported (sliding-window attention)"
        )
    as_llama = {**d, "architectures": ["LlamaForCausalLM"], "use_sliding_window": False}
    config = llama.read_config(as_llama)
    return dataclasses.replace(
        config,
        architecture=d["architectures"][0],
        model_type=d.get("model_type") or "qwen3",
        family="qwen3",
    )
