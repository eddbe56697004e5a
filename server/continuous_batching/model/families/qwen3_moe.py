"""Qwen3-MoE: the llama block with q/k RMSNorm per head and a mixture of experts in the MLP of
every ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` (the others: a dense MLP
of ``intermediate_size``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..architecture import ModelArchConfig
from . import llama

#: Hugging Face architecture -> the model_type it implies when config.json omits one.
ARCHITECTURES: dict[str, str] = {"Qwen3MoeForCausalLM": "qwen3_moe"}


def read_config(d: dict[str, Any]) -> ModelArchConfig:
    """ModelArchConfig of a Qwen3-MoE ``config.json``. Hub checkpoints name the expert count
    ``num_experts``; transformers 5 saves it as ``num_local_experts``: both are read."""
    arch = d["architectures"][0]
    base = llama.read_config({**d, "architectures": ["LlamaForCausalLM"]})
    num_experts = d.get("num_experts", d.get("num_local_experts"))
    return dataclasses.replace(
        base,
        architecture=arch,
        model_type=d.get("model_type") or ARCHITECTURES[arch],
        family="qwen3_moe",
        num_experts=int(num_experts or 0),
        num_experts_per_tok=int(d.get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or base.intermediate_size),
        # transformers' Qwen3MoeConfig default (the Hub checkpoints set it true).
        is_norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
    )
