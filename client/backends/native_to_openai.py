"""Native ``/generate`` requests answered by an OpenAI-compatible upstream (jumper fallback).

A native request with ``messages`` becomes a chat completion, one with ``prompt`` a text
completion; the answer (or each stream event) is turned back into the native shape. The
presence and frequency penalties and ``logit_bias`` go as they are (the OpenAI API has them, with
the same meaning). Requests that use what the OpenAI API lacks (beam search, top-k, typical-p,
min-p, repetition penalty, minimum length, stop token ids, ignore-EOS, allowed token ids, bad
words, vLLM's structured outputs, stop strings kept in the text, special tokens shown) are never
sent upstream: the answer would silently differ from what was asked.
"""

from __future__ import annotations

import json
from typing import Any

from client.backends.translation import StreamTranslator, Translation
from client.endpoints import Endpoint
from protocol.generation import GenerateRequest, GenerationConfig
from utils.sse import SSEDataSplitter, encode_done, encode_event

#: Native generation fields the OpenAI API cannot honour, with the value that means "unused".
_UPSTREAM_UNSUPPORTED: dict[str, object] = {
    "num_beams": 1,
    "top_k": 0,
    "typical_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "stop_token_ids": [],
    "ignore_eos": False,
    "allowed_token_ids": None,
    "bad_words": [],
    "structured_outputs": None,  # vLLM's; OpenAI has only response_format (json_schema)
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    # OpenAI's logprobs answer in another shape than the native entries (token ids).
    "logprobs": None,
    "logprobs_mode": "raw",
    "prompt_logprobs": None,
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
        path = Endpoint.CHAT
        body["messages"] = [message.model_dump(exclude_none=True) for message in request.messages]
    else:
        path = Endpoint.COMPLETIONS
        body["prompt"] = request.prompt
    if config.max_new_tokens is not None:
        body["max_tokens"] = config.max_new_tokens
    if config.do_sample:
        body.update(temperature=config.temperature, top_p=config.top_p)
    else:
        body["temperature"] = 0.0  # greedy
    if config.presence_penalty:
        body["presence_penalty"] = config.presence_penalty
    if config.frequency_penalty:
        body["frequency_penalty"] = config.frequency_penalty
    if config.logit_bias:
        # OpenAI's keys are the token ids as strings (JSON object keys).
        body["logit_bias"] = {str(token): bias for token, bias in config.logit_bias.items()}
    if config.num_return_sequences > 1:
        body["n"] = config.num_return_sequences
    if config.stop:
        body["stop"] = config.stop
    if config.seed is not None:
        body["seed"] = config.seed
    if config.json_schema is not None:
        schema = config.json_schema
        body["response_format"] = (
            {"type": "json_object"}
            if schema == {"type": "object"}
            else {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
        )
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
        "usage": data.get("usage") or dict.fromkeys(_USAGE_FIELDS, 0),
    }
    return json.dumps(answer).encode()


class OpenAIStreamTranslator(StreamTranslator):
    """Turns an OpenAI stream into native stream events, whatever the byte chunking."""

    def __init__(self, model: str | None) -> None:
        self.model = model
        self._splitter = SSEDataSplitter()

    def feed(self, data: bytes) -> bytes:
        """Native events for every complete upstream event in ``data`` (kept until complete)."""
        return b"".join(self._translate(payload) for payload in self._splitter.feed(data))

    def _translate(self, payload: bytes) -> bytes:
        if payload.strip() == b"[DONE]":
            return encode_done()
        data = json.loads(payload)
        if "error" in data:
            return encode_event(data)
        choices = [
            _native_choice(choice)
            for choice in data.get("choices", [])
            if _native_choice(choice)["text"] or choice.get("finish_reason")
        ]
        usage = data.get("usage")
        if not choices and not usage:
            return b""  # e.g. the chat stream's opening role-only event
        chunk: dict[str, Any] = {
            "id": data.get("id", ""),
            "model": self.model or data.get("model", ""),
            "choices": choices,
        }
        if usage:
            chunk["usage"] = usage
        return encode_event(chunk)


class NativeToOpenAI(Translation):
    """A native request asked of an OpenAI-compatible upstream."""

    def __init__(self, native: GenerateRequest, upstream_model: str | None, model: str | None):
        self.native = native
        self.upstream_model = upstream_model
        self.model = model

    def request(self) -> tuple[str, bytes]:
        """A chat completion for ``messages``, a completion for ``prompt``."""
        return to_openai(self.native, self.upstream_model)

    def answer(self, body: bytes) -> bytes:
        """The native answer, named after the caller's model."""
        return answer_from_openai(body, self.model)

    def stream(self) -> StreamTranslator:
        """Native events for the upstream's stream."""
        return OpenAIStreamTranslator(self.model)
