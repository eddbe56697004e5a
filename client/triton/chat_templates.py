"""Chats rendered into prompt text for Triton servers (TensorRT-LLM applies no chat template):
the tokenizer named by the entry's ``chat_template_from``, loaded once, and the suite's one
renderer (``utils.chat_template``)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from protocol.generation import ChatMessage
from utils.chat_template import render_chat as render_with


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
    with the assistant's turn opened (as the servers render a chat request); raises
    ``ChatTemplateError`` (a ``ValueError``) when it cannot."""
    return render_with(_tokenizer(path), messages)
