"""Tiny random checkpoints of the model families, built with transformers' own config and
model classes and saved with the default model's tokenizer, a small chat template modelled on
the family's real one and a ``generation_config.json``; and transformers' greedy tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

#: Shapes shared by every tiny checkpoint (vocab: the default model's tokenizer).
TINY_SHAPES: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    # Wide random weights: well separated logits, so greedy choices are not near-ties.
    "initializer_range": 0.3,
}

#: Qwen3's template structure: ChatML turns, earlier answers' <think> parts dropped, and
#: ``enable_thinking=False`` pre-filling an empty think block.
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- if '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

#: Phi-3's template structure: <|role|> headers closed by <|end|>.
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def save_checkpoint(
    model: PreTrainedModel,
    folder: Path,
    tokenizer_from: Path,
    chat_template: str,
    eos_token_ids: list[int],
    max_shard_size: str | None = None,
) -> Path:
    """Save ``model`` (sharded when ``max_shard_size`` is given) with ``tokenizer_from``'s
    tokenizer, ``chat_template`` and a generation config listing ``eos_token_ids``."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    (folder / "chat_template.jinja").write_text(chat_template)
    generation = {"bos_token_id": 1, "eos_token_id": eos_token_ids}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def hf_greedy_tokens(hf: PreTrainedModel, prompt: list[int], num_new: int) -> list[int]:
    """transformers' greedy continuation, one token per forward over its KV cache (as its
    generate() decodes), without any stop token."""
    tokens: list[int] = []
    with torch.inference_mode():
        out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(num_new):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = hf(
                input_ids=torch.tensor([[token]]),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return tokens
