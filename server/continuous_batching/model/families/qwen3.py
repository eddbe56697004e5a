"""Qwen3: the llama block plus an RMSNorm over each q and k head before RoPE (``q_norm`` and
``k_norm``, weights of ``head_dim``), without q/k/v bias unless ``attention_bias`` says so."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..architecture import ModelArchConfig
from . import llama

ARCHITECTURES: dict[str, str] = {"Qwen3ForCausalLM": "qwen3"}


def read_config(d: dict[str, Any]) -> ModelArchConfig:
    """ModelArchConfig of a Qwen3 ``config.json`` (family "qwen3": ``model.qwen3``'s block).

    Released Qwen3 checkpoints say ``use_sliding_window: false``; one that turns it on gets
    Qwen2's rule, as transformers' Qwen3Config: the window on the layers from
    ``max_window_layers`` on, or on those its ``layer_types`` name."""
    config = llama.read_config({**d, "architectures": ["LlamaForCausalLM"]})
    sliding_window, layer_types = llama._read_window(d, "qwen2")
    return dataclasses.replace(
        config,
        sliding_window=sliding_window,
        layer_types=layer_types,
        architecture=d["architectures"][0],
        model_type=d.get("model_type") or "qwen3",
        family="qwen3",
    )
