"""Native requests asked of a Triton server's generate extension (TensorRT-LLM's ensemble
fields), and its answers and streams read back in native terms (an OpenAI caller's are then
shaped by ``client.backends.native_as_openai``).

Triton reports neither token counts nor why generation ended, so answers from it carry zero
usage and no ``finish_reason``.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from client.backends.translation import StreamTranslator, Translation
from client.triton.chat_templates import render_chat
from client.triton.protocol import TritonGenerateRequest
from client.triton.responses import TritonGenerateResponse
from protocol.generation import GenerateRequest
from utils.errors import APIError
from utils.sse import SSEDataSplitter, encode_done, encode_event

if TYPE_CHECKING:
    from client.triton.config import TritonServerConfig

_ZERO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def _choices(texts: list[str]) -> list[dict[str, Any]]:
    # Triton does not say why generation ended: finish_reason stays unknown (null).
    return [{"index": i, "text": text, "finish_reason": None} for i, text in enumerate(texts)]


def _native_error(status: int, message: str) -> dict[str, Any]:
    return APIError(status, f"Triton server: {message}").to_response().model_dump()


def _triton_message(body: bytes) -> str:
    """The message of a Triton error body (``{"error": "..."}``), or the body itself."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:500]
    error = data.get("error") if isinstance(data, dict) else None
    return str(error).strip() if error is not None else str(data)[:500]


class NativeToTriton(Translation):
    """A native request asked of a Triton server's generate extension.

    Built when routing asks the Triton backend about a request: the Triton request is made
    (and so validated) here, once; ``ValueError`` names what Triton cannot express.
    """

    def __init__(
        self,
        native: GenerateRequest,
        triton_model: str,
        model: str | None,
        config: TritonServerConfig,
    ) -> None:
        self.native = native
        self.triton_model = triton_model
        self.model = model or triton_model
        self.config = config
        # Triton echoes an id only when the request had one: native answers always carry one.
        self.request_id = f"triton-{uuid.uuid4().hex}"
        prompt = native.prompt or ""
        if native.messages is not None and config.chat_template_from:
            prompt = render_chat(config.chat_template_from, native.messages)
        triton_request = TritonGenerateRequest.from_generate_request(
            native, prompt, default_max_tokens=config.default_max_tokens
        )
        endpoint = "generate_stream" if native.stream else "generate"
        self._path = f"/v2/models/{triton_model}/{endpoint}"
        self._body = json.dumps(triton_request.to_triton_json()).encode()

    def request(self) -> tuple[str, bytes]:
        """``generate`` or ``generate_stream`` with TensorRT-LLM's fields."""
        return self._path, self._body

    def answer(self, body: bytes) -> bytes:
        """The native answer: one choice per returned text."""
        data = json.loads(body)
        if "error" in data:  # Triton reports some failures with status 200
            raise APIError(502, f"Triton server: {_triton_message(body)}")
        texts = TritonGenerateResponse.model_validate(data).texts()
        answer = {
            "id": data.get("id") or self.request_id,
            "model": self.model,
            "choices": _choices(texts),
            "usage": _ZERO_USAGE,
        }
        return json.dumps(answer).encode()

    def error(self, status: int, body: bytes) -> tuple[int, bytes]:
        """Triton's ``{"error": "..."}`` in the suite's error shape.

        Triton's 404 (it does not know the model name the gateway sent) and 5xx are the
        gateway's or the server's fault, not the caller's: they become 502, which is retried
        on another server and counts against this one's circuit. Its 400s (a request it
        refuses) stay 400.
        """
        if status == 404 or status >= 500:
            status = 502
        return status, json.dumps(_native_error(status, _triton_message(body))).encode()

    def stream(self) -> StreamTranslator:
        """Native events for Triton's stream (which has no end marker of its own)."""
        return TritonStreamTranslator(self.model, self.request_id)


class TritonStreamTranslator(StreamTranslator):
    """Triton ``generate_stream`` events -> native stream chunks, then usage and ``[DONE]``."""

    def __init__(self, model: str, request_id: str) -> None:
        self.model = model
        self.request_id = request_id
        self._splitter = SSEDataSplitter()
        self._has_failed = False

    def feed(self, data: bytes) -> bytes:
        """A native chunk per Triton event with text; an error event for a Triton error."""
        out: list[bytes] = []
        for payload in self._splitter.feed(data):
            event = json.loads(payload)
            if "error" in event:
                self._has_failed = True
                out.append(encode_event(_native_error(502, _triton_message(payload))))
                continue
            texts = TritonGenerateResponse.model_validate(event).texts()
            choices = [choice for choice in _choices(texts) if choice["text"]]
            if choices:
                chunk = {"id": self.request_id, "model": self.model, "choices": choices}
                out.append(self._encode(chunk))
        return b"".join(out)

    def close(self) -> bytes:
        """Triton's stream just ends: close it the native way (usage chunk, ``[DONE]``)."""
        if self._has_failed:
            return b""
        usage_chunk = {
            "id": self.request_id,
            "model": self.model,
            "choices": [],
            "usage": _ZERO_USAGE,
        }
        return self._encode(usage_chunk) + encode_done()

    def _encode(self, chunk: dict[str, Any]) -> bytes:
        return encode_event(chunk)
