"""OpenAI requests for backends that only speak the native API's terms (Triton servers), and
native answers turned back into OpenAI (chat) completions.

``native_equivalent`` gives the native request that asks the same as an OpenAI one, when there
is one (one string prompt or one conversation; options the native API has). ``OpenAIShaper``
turns native answer dicts and stream chunks into the shape the caller's endpoint promises.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError

from protocol.generation import GenerateRequest
from protocol.openai_api import ChatCompletionRequest, CompletionRequest
from utils.sse import encode_done, encode_event

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def native_equivalent(
    parsed: GenerateRequest | CompletionRequest | ChatCompletionRequest,
) -> GenerateRequest | None:
    """The native request for ``parsed`` (itself when native), or None when none says the same
    (several prompts, token-id prompts, a continued final message, template arguments)."""
    if isinstance(parsed, GenerateRequest):
        return parsed
    try:
        config = parsed.to_generation_config()
    except (ValueError, ValidationError):
        return None
    if isinstance(parsed, CompletionRequest):
        prompts = parsed.prompts()
        if len(prompts) != 1 or not isinstance(prompts[0], str) or parsed.echo:
            return None
        return GenerateRequest(
            model=parsed.model, prompt=prompts[0], generation_config=config, stream=parsed.stream
        )
    if parsed.continue_final_message or parsed.chat_template_kwargs:
        return None
    return GenerateRequest(
        model=parsed.model, messages=parsed.messages, generation_config=config, stream=parsed.stream
    )


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

    @staticmethod
    def done() -> bytes:
        """The closing ``[DONE]`` event."""
        return encode_done()
