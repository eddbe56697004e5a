"""Tiny random checkpoints of any family, written as a real Hugging Face folder.

transformers' own config and model classes build them (random weights, fixed seed); the
default model's tokenizer files go beside them, so llama.cpp's converter and our renderer
see a real tokenizer and chat template. The vocabulary is the tokenizer's (49,152 ids).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

#: The default model's files that describe its tokenizer and chat template.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)

#: The default model's vocabulary size: a tiny model using its tokenizer needs every id.
VOCAB_SIZE = 49152


def write_tiny_checkpoint(
    config: PretrainedConfig,
    folder: Path,
    tokenizer_from: Path,
    seed: int = 0,
    max_shard_size: str | None = None,
) -> PreTrainedModel:
    """Build a random float32 model of ``config``, save it (sharded when ``max_shard_size``)
    with the tokenizer of ``tokenizer_from`` into ``folder``; returns the model (eval mode)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    return model


#: The shape every tiny family shares (GQA, two layers, a vocabulary the tokenizer covers;
#: wide random weights keep greedy choices away from near-ties).
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.3,
}


def _tiny(config_class: str, **fields: Any) -> Callable[[], PretrainedConfig]:
    """A builder of ``transformers.<config_class>(**SHAPE, **fields)``."""

    def build() -> PretrainedConfig:
        return getattr(transformers, config_class)(**{**SHAPE, **fields})

    return build


#: Family name -> its tiny config, built by transformers' own config class. Each family the
#: engine runs is listed, so the end-to-end tests serve every one of them.
TINY_FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": _tiny("LlamaConfig", tie_word_embeddings=False),
    "mistral": _tiny("MistralConfig", sliding_window=8),
    "qwen2": _tiny("Qwen2Config", tie_word_embeddings=True),
    "qwen3": _tiny("Qwen3Config", head_dim=32, tie_word_embeddings=True),
    "phi3": _tiny("Phi3Config", pad_token_id=0),
    "gemma2": _tiny("Gemma2Config", head_dim=16, query_pre_attn_scalar=24, sliding_window=8),
    "gemma3": _tiny(
        "Gemma3TextConfig",
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "mixtral": _tiny("MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": _tiny(
        "Qwen3MoeConfig",
        head_dim=32,
        moe_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    ),
}
