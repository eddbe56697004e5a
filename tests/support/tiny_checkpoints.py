"""Tiny random checkpoints of any family, written as a real Hugging Face folder.

transformers' own config and model classes build them (random weights, fixed seed); the
default model's tokenizer files go beside them, so llama.cpp's converter and our renderer
see a real tokenizer and chat template. The vocabulary is the tokenizer's (49,152 ids).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
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


def _tiny_llama() -> PretrainedConfig:
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPE, tie_word_embeddings=False)


#: The shape every tiny family shares (GQA, two layers, a vocabulary the tokenizer covers).
SHAPE: dict[str, int] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: Family name -> its tiny config, built by transformers' own config class. Each family the
#: engine runs is listed, so the end-to-end tests serve every one of them.
TINY_FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": _tiny_llama,
}
