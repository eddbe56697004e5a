"""Triton's generate API on the gateway, so that clients written for Triton + TensorRT-LLM work
unchanged: ``POST /v2/models/{model}/generate`` and ``.../generate_stream``, plus the ready
endpoints.

A Triton request becomes a native ``/generate`` request (``protocol.triton``) and is routed like
any other (balancing, failover, fallback); the native answer comes back in Triton's shape:
``{"model_name", "model_version", "text_output"}``, its stream as Server-Sent Events of that
shape with no end marker, and errors as ``{"error": "<message>"}`` with the HTTP status our
API would give (and its Retry-After). The model in the path is the name the client uses:
``triton_model_aliases`` maps it to a gateway model (by default ``ensemble``, TensorRT-LLM's
name, means "any model").
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from client.forwarding.stream_relay import StreamRelay
from client.intake.forward import (
    count_rejected,
    forward_parsed,
    gateway_of,
    require_caller_key,
    route_of,
)
from protocol.generation import GenerateResponse, GenerateStreamChunk
from protocol.triton import (
    TritonGenerateRequest,
    triton_response,
    triton_stream_response,
)
from utils.errors import APIError, parse_json_body
from utils.http import read_body
from utils.openapi import json_body
from utils.sse import SSE_MEDIA_TYPE, SSEDataSplitter, encode_event

#: The native endpoint Triton requests are routed as.
NATIVE_ENDPOINT = "/generate"

triton_routes = APIRouter(tags=["Triton generate API"])


def _triton_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _error_message(body: bytes) -> str:
    """The message of an error in our shape (or the body, if it is something else)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body.decode("utf-8", "replace")[:500]
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def _gateway_model(request: Request, model: str) -> str | None:
    """The gateway model for the name in the path (``None``: any model)."""
    aliases = gateway_of(request).config.triton_model_aliases
    return (aliases.get(model) or None) if model in aliases else model


@triton_routes.get("/v2/health/live", summary="Triton: the gateway is up")
async def live() -> Response:
    """Always 200 while the gateway answers."""
    return Response(status_code=200)


@triton_routes.get("/v2/health/ready", summary="Triton: some backend can take requests")
async def ready(request: Request) -> Response:
    """200 when at least one backend takes requests, else 503."""
    is_ready = bool(gateway_of(request).registry.healthy())
    return Response(status_code=200 if is_ready else 503)


@triton_routes.get("/v2/models/{model}/ready", summary="Triton: the model can be served now")
async def model_ready(request: Request, model: str) -> Response:
    """200 when a healthy backend serves the model; 400 as Triton answers otherwise."""
    registry = gateway_of(request).registry
    ours = _gateway_model(request, model)
    healthy = registry.healthy()
    if any(ours is None or backend.serves(ours) for backend in healthy):
        return Response(status_code=200)
    return _triton_error(400, "Model version not ready")


@triton_routes.post(
    "/v2/models/{model}/generate",
    dependencies=[Depends(require_caller_key)],
    openapi_extra=json_body(TritonGenerateRequest),
    summary="Triton generate: the whole text in one answer",
)
async def generate(request: Request, model: str) -> Response:
    """Triton's ``generate`` over the gateway's backends."""
    return await _generate(request, model, is_stream_endpoint=False)


@triton_routes.post(
    "/v2/models/{model}/generate_stream",
    dependencies=[Depends(require_caller_key)],
    openapi_extra=json_body(TritonGenerateRequest),
    summary="Triton generate_stream: text deltas as Server-Sent Events",
)
async def generate_stream(request: Request, model: str) -> Response:
    """Triton's ``generate_stream`` over the gateway's backends."""
    return await _generate(request, model, is_stream_endpoint=True)


async def _generate(request: Request, model: str, *, is_stream_endpoint: bool) -> Response:
    received_at = time.monotonic()
    try:
        route = route_of(request)
        body = await read_body(request, gateway_of(request).config.max_request_bytes)
        triton_request = parse_json_body(body, TritonGenerateRequest)
        native = triton_request.to_generate_request(
            _gateway_model(request, model), streaming_endpoint=is_stream_endpoint
        )
    except APIError as exc:
        count_rejected(request, NATIVE_ENDPOINT, received_at)
        return _triton_error(exc.status_code, exc.message, exc.headers)
    native_body = native.model_dump_json(exclude_none=True).encode()
    try:
        response = await forward_parsed(
            request, NATIVE_ENDPOINT, native, native_body, route, received_at
        )
    except APIError as exc:
        return _triton_error(exc.status_code, exc.message, exc.headers)
    if response.status_code >= 400:
        headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
        return _triton_error(response.status_code, _error_message(response.body), headers)
    if isinstance(response, StreamRelay):
        response.body_iterator = _triton_events(response.body_iterator, model, triton_request.id)
        return response
    answer = triton_response(
        GenerateResponse.model_validate_json(response.body), model, request_id=triton_request.id
    )
    if is_stream_endpoint:  # without "stream": true, one event with the whole text
        return Response(encode_event(answer.to_json()), media_type=SSE_MEDIA_TYPE)
    return JSONResponse(answer.to_json())


async def _triton_events(
    native_events: AsyncIterator[bytes | str], model: str, request_id: str | None
) -> AsyncIterator[bytes]:
    """Native stream events -> Triton events (text deltas; errors as ``{"error": "..."}``)."""
    splitter = SSEDataSplitter()
    async for data in native_events:
        raw = data.encode() if isinstance(data, str) else data
        for payload in splitter.feed(raw):
            if payload.strip() == b"[DONE]":
                continue  # Triton's stream has no end marker: it just ends
            event = json.loads(payload)
            if "error" in event:
                yield encode_event({"error": _error_message(payload)})
                continue
            chunk = GenerateStreamChunk.model_validate(event)
            triton_event = triton_stream_response(chunk, model, request_id=request_id)
            if triton_event is not None:
                yield encode_event(triton_event.to_json())
