"""The chat completions shape of an answer: its stream chunks' choices and its whole
answer's, with OpenAI's chat logprobs; with tools, calls read out of the text (streamed as
OpenAI streams them); with a thinking model, the thought split out as ``reasoning_content``."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel

from protocol.generation import TokenLogprob, TopLogprob
from protocol.openai_api import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    FunctionCall,
    ToolCall,
)
from server.common.answers import AnswerShape
from server.common.backend import TextDelta
from server.common.reasoning import ReasoningStream, split_reasoning
from server.common.service import ChoiceResult
from server.common.tool_call_stream import CallDelta, CallStreamReader
from server.common.tool_syntax import ToolSyntax


def _chat_top(entry: TopLogprob | TokenLogprob) -> dict[str, Any]:
    """OpenAI's ``{token, logprob, bytes}`` of one token (``bytes``: its text's UTF-8)."""
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode("utf-8")),
    }


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` (``ChatLogprobs``) of these tokens; None when not asked."""
    if entries is None:
        return None
    return {
        "content": [
            {**_chat_top(e), "top_logprobs": [_chat_top(t) for t in e.top_logprobs]}
            for e in entries
        ]
    }


def _chat_choice(delta: TextDelta, is_opening: bool) -> dict[str, Any] | None:
    """A choice's part of a chat chunk (a ``ChatCompletionChunkChoice``): its new text (and
    its new tokens' logprobs) and, once it ends, its finish reason; None when it has no news
    and is already open.

    OpenAI opens every choice with the assistant role; here the role rides on the choice's
    first delta (as OpenAI-compatible servers such as llama.cpp's do) rather than costing an
    event of its own.
    """
    if not is_opening and not delta.text and delta.finish_reason is None and not delta.logprobs:
        return None
    chat_delta = (
        {"role": "assistant", "content": delta.text}
        if is_opening
        else {"role": None, "content": delta.text or None}
    )
    return {
        "index": delta.index,
        "delta": chat_delta,
        "finish_reason": delta.finish_reason,
        "logprobs": chat_logprobs(delta.logprobs),
    }


def _chat_logprobs_model(entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
    """A whole answer's ``ChatLogprobs`` of a choice's tokens; None when not asked."""
    logprobs = chat_logprobs(entries)
    return None if logprobs is None else ChatLogprobs.model_validate(logprobs)


def _chat_response_choice(r: ChoiceResult) -> ChatCompletionChoice:
    return ChatCompletionChoice(
        index=r.index,
        message=ChatResponseMessage(content=r.text),
        finish_reason=r.finish_reason,
        logprobs=_chat_logprobs_model(r.logprobs),
    )


CHAT = AnswerShape(
    chunk=ChatCompletionChunk,
    chunk_choice=_chat_choice,
    response=ChatCompletionResponse,
    response_choice=_chat_response_choice,
)


def chat_with_tools(syntax: ToolSyntax, *, is_parallel: bool = True) -> AnswerShape:
    """The chat shape when the model may call tools: a stream sends content as it comes and
    each ``<tool_call>`` as a call opened (index, id, name) then argument fragments, as OpenAI
    streams them (:class:`~server.common.tool_call_stream.ToolCallStream`); the last event of
    a choice that called says ``finish_reason: "tool_calls"``. A whole answer reads the calls
    out of the text. ``is_parallel`` false (``parallel_tool_calls: false``): one call at most.
    A step's logprobs ride on the next event that shows the choice. ``syntax``: how the model
    writes calls (Hermes blocks stream as above; the others' calls come whole at the end)."""
    streams: dict[int, CallStreamReader] = {}
    entries: dict[int, list[TokenLogprob]] = {}

    def chunk_choice(delta: TextDelta, is_opening: bool) -> dict[str, Any] | None:
        stream = streams.setdefault(delta.index, syntax.stream(is_parallel=is_parallel))
        part = stream.feed(delta.text)
        if delta.logprobs is not None:
            entries.setdefault(delta.index, []).extend(delta.logprobs)
        if delta.finish_reason is not None:
            end = stream.finish()
            part.content += end.content
            part.calls += end.calls
            del streams[delta.index]
        elif not part.content and not part.calls:
            return None  # nothing to show yet (text held back, the rest of a call)
        chat_delta: dict[str, Any] = {
            "role": "assistant" if is_opening else None,
            "content": part.content or ("" if is_opening and not part.calls else None),
        }
        if part.calls:
            chat_delta["tool_calls"] = [_call_delta(call) for call in part.calls]
        is_called = delta.finish_reason is not None and stream.num_calls > 0
        return {
            "index": delta.index,
            "delta": chat_delta,
            "finish_reason": "tool_calls" if is_called else delta.finish_reason,
            "logprobs": chat_logprobs(entries.pop(delta.index, None)),
        }

    def response_choice(result: ChoiceResult) -> ChatCompletionChoice:
        content, calls = syntax.parse(result.text, is_parallel=is_parallel)
        tool_calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls
        ]
        return ChatCompletionChoice(
            index=result.index,
            message=ChatResponseMessage(content=content, tool_calls=tool_calls or None),
            finish_reason="tool_calls" if calls else result.finish_reason,
            logprobs=_chat_logprobs_model(result.logprobs),
        )

    return AnswerShape(
        chunk=ChatCompletionChunk,
        chunk_choice=chunk_choice,
        response=ChatCompletionResponse,
        response_choice=response_choice,
        is_resumable=False,
    )


def _call_delta(call: CallDelta) -> dict[str, Any]:
    """OpenAI's ``ChoiceDeltaToolCall`` of a call's news: index, then (on its first news) id,
    type and name, then its argument fragment."""
    function: dict[str, Any] = {"arguments": call.arguments}
    if call.id is None:
        return {"index": call.index, "function": function}
    return {
        "index": call.index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, **function},
    }


def with_reasoning(shape: AnswerShape, *, is_thinking: bool, is_included: bool) -> AnswerShape:
    """``shape`` with each answer's ``<think>`` part split out into the message's (or the
    delta's) ``reasoning_content`` (:mod:`server.common.reasoning`); ``is_thinking``: the
    prompt left a thought open. The content (tool calls included) is read from the rest.
    ``is_included`` false (vLLM's ``include_reasoning: false``) drops the reasoning."""
    streams: dict[int, ReasoningStream] = {}

    def chunk_choice(delta: TextDelta, is_opening: bool) -> dict[str, Any] | None:
        stream = streams.setdefault(delta.index, ReasoningStream(is_thinking=is_thinking))
        part = stream.feed(delta.text)
        if delta.finish_reason is not None:
            end = stream.finish()
            part.reasoning += end.reasoning
            part.content += end.content
            del streams[delta.index]
        choice = shape.chunk_choice(dataclasses.replace(delta, text=part.content), is_opening)
        if not part.reasoning or not is_included:
            return choice
        if choice is None:
            role = "assistant" if is_opening else None
            choice = {
                "index": delta.index,
                "delta": {"role": role, "content": None},
                "finish_reason": None,
                "logprobs": None,
            }
        elif choice["delta"].get("content") == "":
            choice["delta"]["content"] = None
        choice["delta"]["reasoning_content"] = part.reasoning
        return choice

    def response_choice(result: ChoiceResult) -> BaseModel:
        reasoning, content = split_reasoning(result.text, is_thinking=is_thinking)
        answer = shape.response_choice(dataclasses.replace(result, text_parts=[content or ""]))
        message = answer.message.model_copy(  # type: ignore[attr-defined]
            update={
                "reasoning_content": reasoning if is_included else None,
                "content": answer.message.content or None,  # type: ignore[attr-defined]
            }
        )
        return answer.model_copy(update={"message": message})

    # A stream another server took over would restart the split mid-answer: not resumable.
    return dataclasses.replace(
        shape, chunk_choice=chunk_choice, response_choice=response_choice, is_resumable=False
    )
