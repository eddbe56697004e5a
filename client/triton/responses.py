"""Triton's answers to ``generate`` and ``generate_stream``, and native answers turned into them.

What a real Triton answers (Triton 2.51, seen against the tests' PyTriton server,
``tests/triton/stand_in/pytriton_server.py``):

* ``generate``: ``{"model_name": "ensemble", "model_version": "1", "text_output": "..."}``
  (``"id"`` first when the request had one; ``text_output`` is a list with several beams);
* ``generate_stream``: Server-Sent Events ``data: {same shape}``, one per response, text
  deltas when the request says ``"stream": true``, a single event with all the text otherwise,
  and no ``[DONE]`` marker: the stream just ends;
* errors: ``{"error": "<message>"}``, status 400 (404 for an unknown model); a streaming request
  that fails before its first response gets the error as one event with status 400.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from protocol.generation import GenerateResponse, GenerateStreamChunk

#: Triton reports the version it served; a TensorRT-LLM model repository has only version 1.
DEFAULT_MODEL_VERSION = "1"


class TritonGenerateResponse(BaseModel):
    """Answer of ``generate`` and each event of ``generate_stream``.

    ``text_output`` is one string, or one per returned sequence (a list) when there are several.
    """

    id: str | None = None
    model_name: str
    model_version: str = DEFAULT_MODEL_VERSION
    text_output: str | list[str]

    def texts(self) -> list[str]:
        """``text_output`` as a list, whatever its shape on the wire."""
        return [self.text_output] if isinstance(self.text_output, str) else list(self.text_output)

    def to_json(self) -> dict[str, Any]:
        """The wire shape: ``id`` only when the request had one, as Triton does."""
        return self.model_dump(exclude_none=True)


class TritonErrorResponse(BaseModel):
    """Triton's error body: one message string."""

    error: str


def _text_output(texts: list[str]) -> str | list[str]:
    return texts[0] if len(texts) == 1 else texts


def triton_response(
    response: GenerateResponse,
    model_name: str,
    *,
    request_id: str | None = None,
    model_version: str = DEFAULT_MODEL_VERSION,
) -> TritonGenerateResponse:
    """Triton's answer for a native (non-streaming) one; choices in index order."""
    texts = [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]
    return TritonGenerateResponse(
        id=request_id,
        model_name=model_name,
        model_version=model_version,
        text_output=_text_output(texts),
    )


def triton_stream_response(
    chunk: GenerateStreamChunk,
    model_name: str,
    *,
    request_id: str | None = None,
    model_version: str = DEFAULT_MODEL_VERSION,
) -> TritonGenerateResponse | None:
    """Triton's event for a native stream chunk, or None when the chunk carries no text.

    Native streams end with a chunk holding only ``finish_reason`` / ``usage``; Triton has no
    such event (its stream simply ends), so the caller skips it.
    """
    texts = [choice.text for choice in sorted(chunk.choices, key=lambda c: c.index)]
    if not any(texts):
        return None
    return TritonGenerateResponse(
        id=request_id,
        model_name=model_name,
        model_version=model_version,
        text_output=_text_output(texts),
    )
