"""Rendering a conversation into prompt text with a tokenizer's chat template: the one
renderer of the suite (our servers render chat requests with it, and the gateway renders chats
for backends that take text only, such as Triton + TensorRT-LLM)."""

from __future__ import annotations

from typing import Any

from protocol.generation import ChatMessage


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: no template (``is_missing``), or the template
    refused it."""

    def __init__(self, message: str, *, is_missing: bool = False) -> None:
        super().__init__(message)
        self.is_missing = is_missing


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """``messages`` in ``tokenizer``'s chat template, by default ending with the assistant's
    turn opened. Raises :class:`ChatTemplateError` saying why it cannot."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "this model has no chat template; send a plain 'prompt' (or use /v1/completions) "
            "instead of 'messages'",
            is_missing=True,
        )
    conversation = [
        # Templates rarely know the newer "developer" role; it means "system".
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]
    try:
        return tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # template errors (e.g. raise_exception) are the caller's
        raise ChatTemplateError(f"cannot render messages with the chat template: {exc}") from exc
