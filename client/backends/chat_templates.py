"""Rendering chats into prompt text with a model's chat template, for backends that take text
only (Triton + TensorRT-LLM applies no template)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from protocol.generation import ChatMessage


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str) -> Any:
    # Imported here: the gateway needs transformers only when a Triton entry renders chats.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


async def preload(path: str) -> None:
    """Load the tokenizer of ``path`` off the event loop (its first use would block it)."""
    await asyncio.to_thread(_tokenizer, path)


def render_chat(path: str, messages: list[ChatMessage]) -> str:
    """The prompt text of ``messages`` in the chat template of the tokenizer at ``path``, ending
    with the assistant's turn opened (as the servers render a chat request)."""
    conversation = []
    for message in messages:
        content = message.content
        if isinstance(content, list):  # text parts: the template expects one string
            content = "".join(part.text for part in content)
        conversation.append({"role": message.role, "content": content or ""})
    return _tokenizer(path).apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
