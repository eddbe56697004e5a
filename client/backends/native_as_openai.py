"""Native answers turned into OpenAI (chat) completions, for OpenAI callers served by a
backend that answers in native terms (a Triton server, through its native-side translation).

``OpenAIShaper`` turns native answer dicts and stream chunks into the shape the caller's
endpoint promises; :class:`NativeAsOpenAI` is the caller-side translation built on it. (The
request goes the other way with ``to_generate_request()`` of the OpenAI request models.)
"""

from __future__ import annotations

import json
import time
from typing import Any

from client.backends.translation import CallerTranslation, StreamTranslator, Translation
from client.endpoints import Endpoint
from protocol.generation import GenerateRequest
from utils.sse import SSEDataSplitter, encode_done, encode_event


class OpenAIShaper:
    """Native answer dicts -> OpenAI (chat) completion dicts for the caller's ``endpoint``."""

    def __init__(self, endpoint: Endpoint, model: str | None, is_usage_streamed: bool) -> None:
        self.is_chat = endpoint == Endpoint.CHAT
        self.model = model
        self.is_usage_streamed = is_usage_streamed
        self.created = int(time.time())
        self._has_role = False

    def _base(self, native_id: str, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl" if self.is_chat else "cmpl"
        answer_id = native_id if native_id.startswith(prefix) else f"{prefix}-{native_id}"
        return {"id": answer_id, "object": obj, "created": self.created, "model": self.model}

    def _named(self, native: dict[str, Any]) -> None:
        # A request naming no model is answered under the model the backend names.
        self.model = self.model or native.get("model", "")

    def _choices(self, native: dict[str, Any], is_chunk: bool) -> list[dict[str, Any]]:
        choices = []
        for choice in native["choices"]:
            text = choice["text"]
            out: dict[str, Any] = {"index": choice["index"]}
            if not self.is_chat:
                out["text"] = text
            elif not is_chunk:
                out["message"] = {"role": "assistant", "content": text}
            else:
                delta: dict[str, Any] = {"content": text}
                if not self._has_role:
                    delta["role"] = "assistant"
                out["delta"] = delta
            out.update(finish_reason=choice["finish_reason"], logprobs=None)
            choices.append(out)
        return choices

    def answer(self, native: dict[str, Any]) -> dict[str, Any]:
        """A whole (chat) completion for a native answer."""
        self._named(native)
        obj = "chat.completion" if self.is_chat else "text_completion"
        answer = self._base(native["id"], obj)
        answer.update(choices=self._choices(native, is_chunk=False), usage=native["usage"])
        return answer

    def chunk(self, native: dict[str, Any]) -> bytes:
        """The OpenAI stream event(s) for a native stream chunk (usage only when asked for)."""
        self._named(native)
        obj = "chat.completion.chunk" if self.is_chat else "text_completion"
        events: list[bytes] = []
        choices = self._choices(native, is_chunk=True)
        if choices:
            self._has_role = True
            events.append(encode_event({**self._base(native["id"], obj), "choices": choices}))
        if native.get("usage") is not None and self.is_usage_streamed:
            usage_event = {**self._base(native["id"], obj), "choices": [], "usage": native["usage"]}
            events.append(encode_event(usage_event))
        return b"".join(events)


class NativeAsOpenAI(CallerTranslation):
    """An OpenAI (chat) completion request asked of a backend that answers in native terms."""

    def __init__(
        self,
        native: GenerateRequest,
        inner: Translation | None,
        endpoint: Endpoint,
        model: str | None,
        is_usage_streamed: bool,
    ) -> None:
        super().__init__(native, inner)
        self.shaper = OpenAIShaper(endpoint, model, is_usage_streamed)

    def from_native(self, answer: dict) -> bytes:
        """The whole (chat) completion."""
        return json.dumps(self.shaper.answer(answer)).encode()

    def stream_from_native(self) -> StreamTranslator:
        """Native events -> OpenAI events (errors and ``[DONE]`` as they are)."""
        return _OpenAIEvents(self.shaper)


class _OpenAIEvents(StreamTranslator):
    def __init__(self, shaper: OpenAIShaper) -> None:
        self.shaper = shaper
        self._splitter = SSEDataSplitter()

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for payload in self._splitter.feed(data):
            if payload.strip() == b"[DONE]":
                out.append(encode_done())
                continue
            event = json.loads(payload)
            out.append(encode_event(event) if "error" in event else self.shaper.chunk(event))
        return b"".join(out)
