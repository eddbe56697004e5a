"""The gateway's intake: a caller's HTTP request checked, parsed and handed to the proxy."""

from __future__ import annotations

import time
from typing import get_args

from fastapi import Request
from fastapi.responses import Response

from client.endpoints import Endpoint
from client.forwarding.failover import FORWARDED_REQUEST_HEADERS
from client.gateway import Gateway
from client.gateway_request import GatewayRequest, ParsedRequest, Route
from client.intake.auth import check_caller
from client.routing_fields import RoutingFields
from utils.errors import APIError, parse_json_body
from utils.http import read_body, run_unless_disconnected
from utils.request_id import request_id_of

#: Header with which a caller restricts where its request may go.
ROUTE_HEADER = "x-llm-route"
#: Header naming a conversation, for session affinity.
SESSION_HEADER = "x-session-id"


def gateway_of(request: Request) -> Gateway:
    """The gateway object of the app serving ``request``."""
    return request.app.state.gateway


async def require_caller_key(request: Request) -> None:
    """401 unless the caller sent one of the configured API keys (when any are configured)."""
    check_caller(request.headers.get("authorization"), gateway_of(request).config.api_keys)


def route_of(request: Request) -> Route:
    """The caller's ``X-LLM-Route`` (default ``auto``); 400 for an unknown value."""
    value = request.headers.get(ROUTE_HEADER, "auto").strip().lower()
    allowed = get_args(Route)
    if value not in allowed:
        raise APIError(
            400, f"header X-LLM-Route must be one of {', '.join(allowed)} (got {value[:40]!r})"
        )
    return value  # type: ignore[return-value]


def count_rejected(request: Request, endpoint: Endpoint, received_at: float) -> None:
    """Count a request the gateway refused before any attempt."""
    metrics = gateway_of(request).metrics
    metrics.count_rejected(endpoint)
    metrics.observe_request(endpoint, "rejected", received_at)


async def forward(request: Request, endpoint: Endpoint) -> Response:
    """Read the body's routing fields, then forward the body as it came.

    Only what the gateway routes on is read (``client.routing_fields``): every other field is
    the backend's to judge, so what a backend can do is never refused here. A relayed request
    (``Endpoint.RELAYED``) keeps its own path, for the upstreams that relay it.
    """
    received_at = time.monotonic()
    try:
        route = route_of(request)
        body = await read_body(request, gateway_of(request).config.max_request_bytes)
        parsed = parse_json_body(body, RoutingFields)
    except APIError:
        count_rejected(request, endpoint, received_at)
        raise
    path = request.url.path if endpoint == Endpoint.RELAYED else None
    return await forward_parsed(request, endpoint, parsed, body, route, received_at, path)


async def forward_parsed(
    request: Request,
    endpoint: Endpoint,
    parsed: ParsedRequest,
    body: bytes,
    route: Route,
    received_at: float,
    path: str | None = None,
) -> Response:
    """Route an already validated request (``body`` is what our servers get)."""
    gateway_request = GatewayRequest(
        endpoint=endpoint,
        path=path,
        parsed=parsed,
        body=body,
        route=route,
        request_id=request_id_of(request.state),
        session_id=request.headers.get(SESSION_HEADER),
        headers={
            name: request.headers[name]
            for name in FORWARDED_REQUEST_HEADERS
            if name in request.headers
        },
        received_at=received_at,
    )
    # A caller giving up on a long non-streaming answer cancels the forward, which drops the
    # upstream connection so the server stops generating for nobody.
    proxy = gateway_of(request).proxy
    return await run_unless_disconnected(request, proxy.forward(gateway_request))
