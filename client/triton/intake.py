"""Triton's generate API on the gateway, so that clients written for Triton + TensorRT-LLM work
unchanged: ``POST /v2/models/{model}/generate`` and ``.../generate_stream``, plus the ready
endpoints.

A Triton request is parsed once into a :class:`~client.triton.call.TritonCall` and routed like
any other (balancing, failover, fallback). A Triton server takes it as it came; any other
backend gets its native form, and its answer comes back in Triton's shape through the
caller-side translation (``client.triton.from_triton``): ``{"model_name", "model_version",
"text_output"}``, its stream as Server-Sent Events of that shape with no end marker. Errors
are ``{"error": "<message>"}`` with the HTTP status our API would give (and its Retry-After).
The model in the path is the name the client uses: ``triton_model_aliases`` maps it to a
gateway model (by default ``ensemble``, TensorRT-LLM's name, means "any model").
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from client.endpoints import Endpoint
from client.intake.forward import (
    count_rejected,
    forward_parsed,
    gateway_of,
    require_caller_key,
    route_of,
)
from client.triton.call import TritonCall
from client.triton.from_triton import error_message
from client.triton.protocol import TritonGenerateRequest
from utils.errors import APIError, parse_json_body
from utils.http import read_body
from utils.openapi import json_body

triton_routes = APIRouter(tags=["Triton generate API"])


def _triton_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


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


#: The two generate endpoints: summary, and whether the answer is an event stream.
_GENERATE_ENDPOINTS = {
    Endpoint.TRITON_GENERATE: ("Triton generate: the whole text in one answer", False),
    Endpoint.TRITON_GENERATE_STREAM: (
        "Triton generate_stream: text deltas as Server-Sent Events",
        True,
    ),
}


def _add_generate_route(endpoint: Endpoint, summary: str, is_stream_endpoint: bool) -> None:
    """``POST <endpoint>`` (its path names the model) over the gateway's backends."""

    async def route(request: Request, model: str) -> Response:
        return await _generate(request, model, endpoint, is_stream_endpoint)

    route.__name__ = endpoint.name.lower()
    route.__doc__ = f"{summary.split(':')[0]} over the gateway's backends."
    triton_routes.add_api_route(
        endpoint.value,
        route,
        methods=["POST"],
        dependencies=[Depends(require_caller_key)],
        openapi_extra=json_body(TritonGenerateRequest),
        summary=summary,
    )


async def _generate(
    request: Request, model: str, endpoint: Endpoint, is_stream_endpoint: bool
) -> Response:
    received_at = time.monotonic()
    try:
        route = route_of(request)
        body = await read_body(request, gateway_of(request).config.max_request_bytes)
        call = TritonCall(
            request=parse_json_body(body, TritonGenerateRequest),
            model_name=model,
            model=_gateway_model(request, model),
            is_stream_endpoint=is_stream_endpoint,
        )
    except APIError as exc:
        count_rejected(request, endpoint, received_at)
        return _triton_error(exc.status_code, exc.message, exc.headers)
    try:
        response = await forward_parsed(request, endpoint, call, body, route, received_at)
    except APIError as exc:
        return _triton_error(exc.status_code, exc.message, exc.headers)
    if response.status_code >= 400:  # backends' errors came translated, the gateway's did not
        headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
        return _triton_error(response.status_code, error_message(response.body), headers)
    return response


for _endpoint, (_summary, _is_stream_endpoint) in _GENERATE_ENDPOINTS.items():
    _add_generate_route(_endpoint, _summary, _is_stream_endpoint)
