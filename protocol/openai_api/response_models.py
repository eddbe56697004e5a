"""Answers of the OpenAI-compatible API: completions, chat completions, their stream chunks,
and the model list."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.generation import Usage

OpenAIFinishReason = Literal["stop", "length", "abort", "tool_calls"]


def _now() -> int:
    return int(time.time())


def _unless_set() -> Any:
    """A field of vLLM's beside OpenAI's (``return_token_ids``, ``prompt_logprobs``,
    ``reasoning_content``): left out of the answer unless set, so OpenAI's shape is unchanged."""
    return Field(default=None, exclude_if=lambda value: value is None)


class _Answer(BaseModel):
    """What every answer object starts with; each answer fixes its ``object``."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob`` of a prompt token or an alternative: ``rank`` is 1 for the likeliest
    token (None for a prompt token outside the alternatives asked for)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionLogprobs(BaseModel):
    """A completion choice's logprobs (OpenAI's legacy shape): per generated token its text,
    logprob, likeliest alternatives ``{text: logprob}`` and offset in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    #: None for an echoed prompt's first token (nothing comes before it).
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a text completion."""

    index: int
    text: str
    finish_reason: OpenAIFinishReason | None = None
    logprobs: CompletionLogprobs | None = None
    #: With vLLM's ``prompt_logprobs``: per prompt token (None for the first) its id's
    #: ``{logprob, rank, decoded_token}`` and its alternatives'.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = _unless_set()
    #: With vLLM's ``return_token_ids``: the choice's prompt and generated token ids.
    prompt_token_ids: list[int] | None = _unless_set()
    token_ids: list[int] | None = _unless_set()


class CompletionResponse(_Answer):
    """Answer of ``POST /v1/completions``; also each stream chunk (object is the same)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    """The function a tool call names, with its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One call of an assistant message (``tool_calls``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """The assistant message of a chat choice."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    #: The model's thought (a ``<think>`` part), split out of the content as vLLM does.
    reasoning_content: str | None = _unless_set()


class ChatTopLogprob(BaseModel):
    """One likeliest alternative of a chat token: its text, logprob and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    """A chat token's logprob with its ``top_logprobs`` alternatives."""

    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """A chat choice's logprobs: one entry per generated token (a chunk's: its new ones)."""

    content: list[ChatTokenLogprob] | None = None


class ChatCompletionChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    finish_reason: OpenAIFinishReason | None = None
    logprobs: ChatLogprobs | None = None
    #: With vLLM's ``return_token_ids``: the generated token ids.
    token_ids: list[int] | None = _unless_set()


class ChatCompletionResponse(_Answer):
    """Answer of ``POST /v1/chat/completions`` (non-streaming)."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: Usage
    #: With vLLM's ``return_token_ids``: the prompt's token ids (the rendered chat).
    prompt_token_ids: list[int] | None = _unless_set()
    #: With vLLM's ``prompt_logprobs``: as a completion choice's.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = _unless_set()


class ChatDelta(BaseModel):
    """The new part of the assistant message in a stream chunk (``tool_calls`` too, when a
    choice ends in calls: kept as an extra, so that deltas without calls do not carry it)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionChunkChoice(BaseModel):
    """One choice of a chat stream chunk."""

    index: int
    delta: ChatDelta
    finish_reason: OpenAIFinishReason | None = None
    logprobs: ChatLogprobs | None = None
    #: With vLLM's ``return_token_ids``: this chunk's generated token ids.
    token_ids: list[int] | None = _unless_set()


class ChatCompletionChunk(_Answer):
    """One Server-Sent Event of a streaming chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None
    #: With vLLM's ``return_token_ids``: the prompt's token ids, on the first chunk.
    prompt_token_ids: list[int] | None = _unless_set()


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "llm-serving-suite"
    max_model_len: int | None = None


class ModelList(BaseModel):
    """Answer of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
