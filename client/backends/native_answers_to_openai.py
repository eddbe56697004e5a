"""Native answers turned into OpenAI (chat) completions, for OpenAI callers served by a
backend that answers in native terms (Triton servers, through ``native_to_triton``).

``OpenAIShaper`` turns native answer dicts and stream chunks into the shape the caller's
endpoint promises. (The request goes the other way with ``to_generate_request()`` of the
OpenAI request models.)
"""

from __future__ import annotations

import time
from typing import Any

from utils.sse import encode_event

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class OpenAIShaper:
    """Native answer dicts -> OpenAI (chat) completion dicts for the caller's ``endpoint``."""

    def __init__(self, endpoint: str, model: str, is_usage_streamed: bool) -> None:
        self.is_chat = endpoint == CHAT_PATH
        self.model = model
        self.is_usage_streamed = is_usage_streamed
        self.created = int(time.time())
        self._has_role = False

    def _base(self, native_id: str, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl" if self.is_chat else "cmpl"
        answer_id = native_id if native_id.startswith(prefix) else f"{prefix}-{native_id}"
        return {"id": answer_id, "object": obj, "created": self.created, "model": self.model}

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
        obj = "chat.completion" if self.is_chat else "text_completion"
        answer = self._base(native["id"], obj)
        answer.update(choices=self._choices(native, is_chunk=False), usage=native["usage"])
        return answer

    def chunk(self, native: dict[str, Any]) -> bytes:
        """The OpenAI stream event(s) for a native stream chunk (usage only when asked for)."""
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
