"""The gateway app: one address for users, routing to the model servers by model.

Native API (``POST /generate``), OpenAI-compatible API (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``) and Triton's generate API
(``/v2/models/{m}/generate`` and ``generate_stream``, see ``client.triton.intake``),
streaming or not. The gateway reads only a request's routing fields (``client.routing_fields``;
a malformed one gets a 400 naming it) and the request travels as one ``GatewayRequest``: the
caller's original JSON, untouched, goes to a healthy server that serves the requested model,
which judges the rest of it (our servers answer for themselves), chosen by the
configured balancing policy (``client.balancing``), with failover to other servers and, when
no local server can take it, to the OpenAI jumpers (``client.forwarding.failover``).
``X-LLM-Route: local|openai|auto`` restricts where a request may go. Every answer carries an
``X-Request-ID`` (the caller's, or a new one), which the servers log too. With ``api_keys`` in
the config, callers must send ``Authorization: Bearer <key>`` (``/health`` and ``/metrics``
stay open for probes and scrapers). The config file is watched and re-read on change (and on
SIGHUP when run directly), without dropping requests.

Run: ``python client_app.py --config configs/client_config.json --port 8000``; gunicorn calls
``build_app(config_path)``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel

from client.config.loading import load_client_config
from client.endpoints import ENDPOINT_SPECS, Endpoint
from client.gateway import BackendTable, Gateway, GatewayHealth
from client.intake.forward import forward, gateway_of, require_caller_key
from client.triton.intake import triton_routes
from client.triton.protocol import TritonGenerateRequest
from protocol.openai_api import ModelList
from utils.config import ConfigError
from utils.connection_limits import ConnectionLimits, set_limits
from utils.errors import APIError, install_error_handlers
from utils.logging import setup_logging
from utils.openapi import document_models, json_body
from utils.request_id import RequestIdMiddleware

DEFAULT_CONFIG_PATH = "configs/client_config.json"

#: Routes that need the caller's key (when keys are configured).
routes = APIRouter(dependencies=[Depends(require_caller_key)])
#: Routes open to everyone: liveness probes and metrics scrapers carry no key.
open_routes = APIRouter()
#: Any other POST path, for the upstreams that relay it (``relayed_paths``); included last.
relay_routes = APIRouter(dependencies=[Depends(require_caller_key)])


@relay_routes.post("/{relayed_path:path}", include_in_schema=False)
async def relayed(request: Request) -> Response:
    """A path an OpenAI-compatible upstream relays (vLLM's ``/v1/rerank`` ...), forwarded as
    it came to one that lists it; 404 when none does."""
    path = request.url.path
    entries = gateway_of(request).config.openai_compatible_server_urls
    if not any(path in entry.relayed_paths for entry in entries):
        raise APIError(
            404,
            f"no route for POST {path}: no OpenAI-compatible upstream lists it in relayed_paths",
        )
    return await forward(request, Endpoint.RELAYED)


def _add_forwarding_route(endpoint: Endpoint) -> None:
    """``POST <endpoint>``: validate the body against the endpoint's model, then route it."""
    spec = endpoint.spec

    async def route(request: Request) -> Response:
        return await forward(request, endpoint)

    route.__doc__ = spec.description
    route.__name__ = endpoint.name.lower()
    routes.add_api_route(
        endpoint.value,
        route,
        methods=["POST"],
        summary=spec.summary,
        openapi_extra=json_body(spec.schema),
    )


for _endpoint in ENDPOINT_SPECS:
    _add_forwarding_route(_endpoint)


@routes.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    """The models served by healthy backends, each once."""
    return await gateway_of(request).model_list()


@open_routes.get("/health", response_model=GatewayHealth)
async def health(request: Request) -> GatewayHealth:
    """The gateway's liveness and the health of every backend."""
    return gateway_of(request).health()


@routes.get("/backends", response_model=BackendTable)
async def backends(request: Request) -> BackendTable:
    """Status table of every backend: health, models, reported load, in-flight count."""
    return gateway_of(request).backend_table()


@routes.get("/openapi.json", include_in_schema=False)
async def openapi_schema(request: Request) -> JSONResponse:
    """The OpenAPI schema; behind the caller keys like the API it describes."""
    return JSONResponse(request.app.openapi())


@routes.get("/docs", include_in_schema=False)
async def docs() -> HTMLResponse:
    """Swagger UI over ``/openapi.json`` (with ``api_keys`` set, both need a key)."""
    return get_swagger_ui_html(openapi_url="/openapi.json", title="LLM serving suite gateway")


@open_routes.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    content, content_type = gateway_of(request).metrics.render()
    return Response(content, media_type=content_type)


def build_app(config_path: str = DEFAULT_CONFIG_PATH) -> FastAPI:
    """The gateway app for the config at ``config_path`` (raises ``ConfigError`` if invalid)."""
    setup_logging()
    # httpx logs every request at INFO: one line per forwarded request and per health check.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = load_client_config(config_path)
    gateway = Gateway(config, config_path)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        _install_sighup_reload(gateway)
        try:
            yield
        finally:
            await gateway.stop()

    # The docs routes are ours (in ``routes``): FastAPI's own would skip the caller keys.
    app = FastAPI(
        title="LLM serving suite gateway",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.gateway = gateway
    set_limits(app, ConnectionLimits.of(config))
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)
    app.include_router(routes)
    app.include_router(triton_routes)
    app.include_router(open_routes)
    app.include_router(relay_routes)
    documented: list[type[BaseModel]] = [spec.schema for spec in ENDPOINT_SPECS.values()]
    document_models(app, [*documented, TritonGenerateRequest])
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
        description="LLM gateway: routes native, OpenAI-compatible and Triton generate "
        "requests to the model servers listed in the config (continuous-batching, "
        "static-batching and Triton servers), by model, with health checks, a balancing "
        "policy, failover and fallback to OpenAI-compatible upstreams. The config is re-read "
        "when the file changes or on SIGHUP.",
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
    from utils.serving import serve

    serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
