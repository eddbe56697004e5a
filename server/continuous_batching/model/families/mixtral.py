"""Mixtral: the llama block with a mixture of experts in place of the MLP (every layer)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..architecture import ModelArchConfig, UnsupportedModelError
from . import llama

#: Hugging Face architecture -> the model_type it implies when config.json omits one.
ARCHITECTURES: dict[str, str] = {"MixtralForCausalLM": "mixtral"}


def read_config(d: dict[str, Any]) -> ModelArchConfig:
    """ModelArchConfig of a Mixtral ``config.json``: llama's fields plus the experts. The
    router always renormalises its top-k weights (transformers' ``MixtralTopKRouter``)."""
    arch = d["architectures"][0]
    max_positions = int(d.get("max_position_embeddings", 2048))
    window = d.get("sliding_window")
    if window is not None and int(window) < max_positions:
        # A window at least as long as any sequence changes nothing; a shorter one would.
        raise UnsupportedModelError(
            f"Mixtral sliding_window {window} < max_position_embeddings {max_positions} "
            "is not supported"
        )
    base = llama.read_config({**d, "architectures": ["LlamaForCausalLM"], "sliding_window": None})
    return dataclasses.replace(
        base,
        architecture=arch,
        model_type=d.get("model_type") or ARCHITECTURES[arch],
        family="mixtral",
        num_experts=int(d["num_local_experts"]),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=base.intermediate_size,
        is_norm_topk_prob=True,
    )
