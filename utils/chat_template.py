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


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The template's view of ``messages``: role and content text, plus the tool fields a
    template that knows tools reads (``tool_calls``, ``tool_call_id``, ``name``)."""
    conversation = []
    for message in messages:
        # Templates rarely know the newer "developer" role; it means "system".
        role = "system" if message.role == "developer" else message.role
        turn: dict[str, Any] = {"role": role, "content": message.text()}
        extra = message.model_extra or {}
        for key in ("tool_calls", "tool_call_id"):
            if extra.get(key) is not None:
                turn[key] = extra[key]
        if message.name is not None:
            turn["name"] = message.name
        conversation.append(turn)
    return conversation


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
    return render_conversation(
        tokenizer,
        conversation_of(messages),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
    )


def render_conversation(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """``conversation`` (role/content dicts) in ``tokenizer``'s chat template, with ``tools``
    given to the template when there are any."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "this model has no chat template; send a plain 'prompt' (or use /v1/completions) "
            "instead of 'messages'",
            is_missing=True,
        )
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except Exception as exc:  # template errors (e.g. raise_exception) are the caller's
        raise ChatTemplateError(f"cannot render messages with the chat template: {exc}") from exc
