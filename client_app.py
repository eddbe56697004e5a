"""The gateway app: one address for users, routing to the model servers by model.

Native API (``POST /generate``) and OpenAI-compatible API (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``), streaming or not. Requests are validated here (a
bad body gets a 400 naming the field without bothering a server), then the caller's original
JSON is forwarded to a healthy server that serves the requested model, chosen by the
configured balancing policy, with failover to other servers and, when no local server can
take it, to the OpenAI jumpers. ``X-LLM-Route: local|openai|auto`` restricts where a request
may go. With ``api_keys`` in the config, callers must send ``Authorization: Bearer <key>``
(``/health`` and ``/metrics`` stay open for probes and scrapers). The config file is watched
and re-read on change (and on SIGHUP when run directly), without dropping requests.

Run: ``python client_app.py --config configs/client_config.json --port 8000``; gunicorn calls
``build_app(config_path)``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar, get_args

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from client.auth import check_caller
from client.config import ClientConfig
from client.gateway import BackendTable, Gateway, GatewayHealth
from client.native_translation import upstream_unsupported_fields
from client.policies import affinity_key_of
from client.proxy import FORWARDED_REQUEST_HEADERS, ForwardRequest
from client.requests import RequestInfo, Route
from protocol.generation import GenerateRequest
from protocol.openai_api import ChatCompletionRequest, CompletionRequest, ModelList
from utils.config import ConfigError, load_config
from utils.errors import APIError, install_error_handlers, validation_api_error
from utils.http import run_unless_disconnected
from utils.logging import setup_logging

DEFAULT_CONFIG_PATH = "configs/client_config.json"

RequestT = TypeVar("RequestT", GenerateRequest, CompletionRequest, ChatCompletionRequest)

#: Header with which a caller restricts where its request may go.
ROUTE_HEADER = "x-llm-route"
#: Header naming a conversation, for session affinity.
SESSION_HEADER = "x-session-id"


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


async def require_caller_key(request: Request) -> None:
    """401 unless the caller sent one of the configured API keys (when any are configured)."""
    check_caller(request.headers.get("authorization"), _gateway(request).config.api_keys)


#: Routes that need the caller's key (when keys are configured).
routes = APIRouter(dependencies=[Depends(require_caller_key)])
#: Routes open to everyone: liveness probes and metrics scrapers carry no key.
open_routes = APIRouter()


def _route_of(request: Request) -> Route:
    value = request.headers.get(ROUTE_HEADER, "auto").strip().lower()
    allowed = get_args(Route)
    if value not in allowed:
        raise APIError(
            400, f"header X-LLM-Route must be one of {', '.join(allowed)} (got {value[:40]!r})"
        )
    return value  # type: ignore[return-value]


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) anything over ``max_bytes`` without reading it all."""
    too_large = APIError(413, f"the request body is larger than the limit of {max_bytes} bytes")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, "invalid Content-Length header")
        if int(declared) > max_bytes:
            raise too_large
    chunks: list[bytes] = []
    num_bytes = 0
    async for chunk in request.stream():  # also covers chunked bodies without Content-Length
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _validate(body: bytes, schema: type[RequestT]) -> RequestT:
    """Parse and validate the body; 400 naming the offending field on failure."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise validation_api_error(exc) from None


async def _forward(request: Request, endpoint: str, schema: type[RequestT]) -> Response:
    """Validate the caller's body against ``schema``, then forward the body unchanged.

    Forwarding the original bytes (not the parsed model) lets fields the gateway does not know
    but the server does pass through.
    """
    received_at = time.monotonic()
    gateway = _gateway(request)
    try:
        route = _route_of(request)
        body = await _read_body(request, gateway.config.max_request_bytes)
        parsed = _validate(body, schema)
    except APIError:
        gateway.metrics.observe_attempt(None, endpoint, "rejected", received_at)
        gateway.metrics.observe_request(endpoint, "rejected", received_at)
        raise
    headers = {
        name: request.headers[name] for name in FORWARDED_REQUEST_HEADERS if name in request.headers
    }
    affinity_key = affinity_key_of(
        request.headers.get(SESSION_HEADER),
        getattr(parsed, "user", None),
        getattr(parsed, "prompt", None),
        getattr(parsed, "messages", None),
    )
    native = parsed if isinstance(parsed, GenerateRequest) else None
    info = RequestInfo(
        endpoint=endpoint,
        model=parsed.model or None,
        is_stream=parsed.stream,
        route=route,
        affinity_key=affinity_key,
        upstream_unsupported=upstream_unsupported_fields(native) if native else (),
    )
    forward_request = ForwardRequest(
        info=info,
        native=native,
        path=endpoint,
        body=body,
        headers=headers,
        received_at=received_at,
    )
    # A caller giving up on a long non-streaming answer cancels the forward, which drops the
    # upstream connection so the server stops generating for nobody.
    return await run_unless_disconnected(request, gateway.proxy.forward(forward_request))


@routes.post("/generate", summary="Native generation (prompt or messages), streaming or not")
async def generate(request: Request) -> Response:
    """Route a native generation request by its ``model``."""
    return await _forward(request, "/generate", GenerateRequest)


@routes.post("/v1/completions", summary="OpenAI-compatible text completion")
async def completions(request: Request) -> Response:
    """Route an OpenAI completion request by its ``model``."""
    return await _forward(request, "/v1/completions", CompletionRequest)


@routes.post("/v1/chat/completions", summary="OpenAI-compatible chat completion")
async def chat_completions(request: Request) -> Response:
    """Route an OpenAI chat completion request by its ``model``."""
    return await _forward(request, "/v1/chat/completions", ChatCompletionRequest)


@routes.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    """The models served by healthy backends, each once."""
    return await _gateway(request).model_list()


@open_routes.get("/health", response_model=GatewayHealth)
async def health(request: Request) -> GatewayHealth:
    """The gateway's liveness and the health of every backend."""
    return _gateway(request).health()


@routes.get("/backends", response_model=BackendTable)
async def backends(request: Request) -> BackendTable:
    """Status table of every backend: health, models, reported load, in-flight count."""
    return _gateway(request).backend_table()


@open_routes.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    content, content_type = _gateway(request).metrics.render()
    return Response(content, media_type=content_type)


def build_app(config_path: str = DEFAULT_CONFIG_PATH) -> FastAPI:
    """The gateway app for the config at ``config_path`` (raises ``ConfigError`` if invalid)."""
    setup_logging()
    # httpx logs every request at INFO: one line per forwarded request and per health check.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = load_config(config_path, ClientConfig)
    gateway = Gateway(config, config_path)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        _install_sighup_reload(gateway)
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="LLM serving suite gateway", version="0.1.0", lifespan=lifespan)
    app.state.gateway = gateway
    install_error_handlers(app)
    app.include_router(routes)
    app.include_router(open_routes)
    return app


def _install_sighup_reload(gateway: Gateway) -> None:
    """SIGHUP re-reads the config (standalone runs; under gunicorn the master owns SIGHUP and
    restarts its workers gracefully, which re-reads the config too)."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[bool]] = set()

    def on_sighup() -> None:
        task = loop.create_task(gateway.reload())
        tasks.add(task)  # keep a reference until done
        task.add_done_callback(tasks.discard)

    # Only possible in the main thread (not where tests run the app in a thread).
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGHUP, on_sighup)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: serve the gateway in the foreground with uvicorn."""
    parser = argparse.ArgumentParser(
        prog="python client_app.py",
        description="LLM gateway: routes native and OpenAI-compatible requests to the model "
        "servers listed in the config, by model, with health checks, a balancing policy, "
        "failover and fallback to OpenAI-compatible upstreams. The config is re-read when the "
        "file changes or on SIGHUP.",
    )
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG_PATH, help="gateway JSON config (default: %(default)s)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        app = build_app(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level)
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
