"""A Triton caller served by a backend that answers in native terms: the native answer (or
stream) turned into Triton's ``{"model_name", "model_version", "text_output"}`` shape, errors
into ``{"error": "<message>"}``. (A Triton backend gets the caller's request as it came.)"""

from __future__ import annotations

import json
from typing import Any

from client.backends.translation import CallerTranslation, StreamTranslator, Translation
from client.triton.call import TritonCall
from client.triton.responses import triton_response, triton_stream_response
from protocol.generation import GenerateResponse, GenerateStreamChunk
from utils.sse import SSE_MEDIA_TYPE, SSEDataSplitter, encode_event


def error_message(body: bytes) -> str:
    """The message of an error body in our shape or Triton's (or the body itself)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body.decode("utf-8", "replace")[:500]
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def triton_error_body(body: bytes) -> bytes:
    """Triton's error body for an error body in our shape (one in Triton's stays the same)."""
    return json.dumps({"error": error_message(body)}).encode()


class TritonFromNative(CallerTranslation):
    """A Triton generate call asked of a backend that answers in native terms."""

    def __init__(self, call: TritonCall, inner: Translation | None) -> None:
        super().__init__(call.to_generate_request(), inner)
        self.call = call

    def from_native(self, answer: dict[str, Any]) -> bytes:
        """Triton's answer; on ``generate_stream`` without ``"stream": true``, one event with
        the whole text."""
        response = GenerateResponse.model_validate(answer)
        triton = triton_response(response, self.call.model_name, request_id=self.call.request.id)
        if self.call.is_stream_endpoint:
            return encode_event(triton.to_json())
        return json.dumps(triton.to_json()).encode()

    def media_type(self, upstream: str) -> str:
        """An event stream on ``generate_stream``, JSON on ``generate``."""
        return SSE_MEDIA_TYPE if self.call.is_stream_endpoint else "application/json"

    def stream_from_native(self) -> StreamTranslator:
        """Native events -> Triton events (text deltas; errors as ``{"error": "..."}``)."""
        return _TritonEvents(self.call)

    def error_from_native(self, status: int, body: bytes) -> tuple[int, bytes]:
        """Triton's error shape, same status."""
        return status, triton_error_body(body)


class _TritonEvents(StreamTranslator):
    """Native stream events -> Triton's (no end marker: Triton's stream just ends)."""

    def __init__(self, call: TritonCall) -> None:
        self.call = call
        self._splitter = SSEDataSplitter()

    def error_event(self, event: bytes) -> bytes:
        """Triton's error event for one of ours."""
        payload = event.decode().removeprefix("data:").strip().encode()
        return encode_event({"error": error_message(payload)})

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for payload in self._splitter.feed(data):
            if payload.strip() == b"[DONE]":
                continue
            event = json.loads(payload)
            if "error" in event:
                out.append(encode_event({"error": error_message(payload)}))
                continue
            chunk = GenerateStreamChunk.model_validate(event)
            triton = triton_stream_response(
                chunk, self.call.model_name, request_id=self.call.request.id
            )
            if triton is not None:
                out.append(encode_event(triton.to_json()))
        return b"".join(out)
