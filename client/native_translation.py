"""Native ``/generate`` requests answered by an OpenAI-compatible upstream (jumper fallback).

A native request with ``messages`` becomes a chat completion, one with ``prompt`` a text
completion; the answer (or each stream event) is turned back into the native shape. Requests
that use what the OpenAI API lacks (beam search, top-k, typical-p, repetition penalty, minimum
length, stop token ids, ignore-EOS) are never sent upstream: the answer would silently differ
from what was asked.
"""

from __future__ import annotations

import json
from typing import Any

from protocol.generation import GenerateRequest, GenerationConfig
from utils.sse import encode_done, encode_event

#: Native generation fields the OpenAI API cannot honour, with the value that means "unused".
_UPSTREAM_UNSUPPORTED: dict[str, object] = {
    "num_beams": 1,
    "top_k": 0,
    "typical_p": 1.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "stop_token_ids": [],
    "ignore_eos": False,
}
_FINISH_REASONS = ("stop", "length")
_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")


def upstream_unsupported_fields(request: GenerateRequest) -> tuple[str, ...]:
    """The ``generation_config`` fields of ``request`` that an OpenAI upstream cannot honour."""
    config = request.generation_config
    return tuple(
        f"generation_config.{name}"
        for name, unused in _UPSTREAM_UNSUPPORTED.items()
        if getattr(config, name) != unused
    )


def to_openai(request: GenerateRequest, upstream_model: str | None) -> tuple[str, bytes]:
    """The OpenAI path and body that ask the same as the native ``request``."""
    config: GenerationConfig = request.generation_config
    body: dict[str, Any] = {}
    if upstream_model:
        body["model"] = upstream_model
    if request.messages is not None:
        path = "/v1/chat/completions"
        body["messages"] = [message.model_dump(exclude_none=True) for message in request.messages]
    else:
        path = "/v1/completions"
        body["prompt"] = request.prompt
    if config.max_new_tokens is not None:
        body["max_tokens"] = config.max_new_tokens
    if config.do_sample:
        body.update(temperature=config.temperature, top_p=config.top_p)
    else:
        body["temperature"] = 0.0  # greedy
    if config.num_return_sequences > 1:
        body["n"] = config.num_return_sequences
    if config.stop:
        body["stop"] = config.stop
    if config.seed is not None:
        body["seed"] = config.seed
    if request.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return path, json.dumps(body).encode()


def _native_choice(choice: dict[str, Any]) -> dict[str, Any]:
    if "message" in choice:
        text = (choice.get("message") or {}).get("content") or ""
    elif "delta" in choice:
        text = (choice.get("delta") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    reason = choice.get("finish_reason")
    if reason is not None and reason not in _FINISH_REASONS:
        reason = "stop"  # e.g. "content_filter": the upstream ended the answer
    return {"index": choice.get("index", 0), "text": text, "finish_reason": reason}


def answer_from_openai(body: bytes, model: str | None) -> bytes:
    """A native ``/generate`` answer from an OpenAI (chat) completion answer."""
    data = json.loads(body)
    answer = {
        "id": data.get("id", ""),
        "model": model or data.get("model", ""),
        "choices": [_native_choice(choice) for choice in data.get("choices", [])],
        "usage": data.get("usage")
        or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }
    return json.dumps(answer).encode()


class StreamTranslator:
    """Turns an OpenAI stream into native stream events, whatever the byte chunking."""

    def __init__(self, model: str | None) -> None:
        self.model = model
        self._buffer = b""

    def feed(self, data: bytes) -> bytes:
        """Native events for every complete upstream event in ``data`` (kept until complete)."""
        # Normalised on the whole buffer: a CRLF may be split across two chunks.
        self._buffer = (self._buffer + data).replace(b"\r\n", b"\n")
        out: list[bytes] = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            out.extend(self._translate(event))
        return b"".join(out)

    def _translate(self, event: bytes) -> list[bytes]:
        payload = b"".join(
            line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if not payload:
            return []  # comments and keep-alives
        if payload == b"[DONE]":
            return [encode_done()]
        data = json.loads(payload)
        if "error" in data:
            return [encode_event(data)]
        choices = [
            _native_choice(choice)
            for choice in data.get("choices", [])
            if _native_choice(choice)["text"] or choice.get("finish_reason")
        ]
        usage = data.get("usage")
        if not choices and not usage:
            return []  # e.g. the chat stream's opening role-only event
        chunk: dict[str, Any] = {
            "id": data.get("id", ""),
            "model": self.model or data.get("model", ""),
            "choices": choices,
        }
        if usage:
            chunk["usage"] = usage
        return [encode_event(chunk)]
