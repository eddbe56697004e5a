"""Builds the FastAPI app of every model server: the generation servers around any
``GenerationBackend`` (``create_server_app``), the embedding server around its service.

``build_server_app`` is the one place that wires what all of them share: the lifespan that
starts and stops the model, the middleware (request ids, the closing log line, the request
counter), the connection limits, the error shape and ``GET /metrics``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response
from pydantic import BaseModel

from protocol.generation import GenerateRequest
from protocol.openai_api import ChatCompletionRequest, CompletionRequest
from protocol.tokenize import DetokenizeRequest, TokenizeRequest
from server.common.backend import GenerationBackend
from server.common.config import ServingSettings
from server.common.metrics import BaseMetrics, RequestCounter, ServerMetrics
from server.common.native_routes import build_native_router
from server.common.openai_routes import build_openai_router
from server.common.request_context import RequestContextMiddleware
from server.common.responses_routes import build_responses_router
from server.common.responses_store import ResponseStore
from server.common.service import GenerationService
from server.common.tokenize_routes import build_tokenize_router
from utils.connection_limits import ConnectionLimits, set_limits
from utils.errors import install_error_handlers
from utils.openapi import document_models
from utils.request_id import RequestIdMiddleware

#: The content type of Prometheus' text exposition.
METRICS_MEDIA_TYPE = "text/plain; version=0.0.4"


class Lifecycle(Protocol):
    """What runs the model: started with the app, shut down with it."""

    async def start(self) -> None:
        """Start serving (load, warm up, start background tasks)."""

    async def shutdown(self) -> None:
        """Stop serving; what is still waiting fails."""


def build_server_app(
    *,
    title: str,
    lifecycle: Lifecycle,
    service: object,
    metrics: BaseMetrics,
    connection_limits: ConnectionLimits,
    routers: Sequence[APIRouter],
    documented: Sequence[type[BaseModel]],
) -> FastAPI:
    """The ASGI app of a model server: ``routers`` over ``service`` (kept in
    ``app.state.service``), ``lifecycle`` started and stopped with the app's lifespan, and
    ``documented`` request bodies in the OpenAPI page (the routes read raw bodies)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await lifecycle.start()
        try:
            yield
        finally:
            await lifecycle.shutdown()

    app = FastAPI(title=title, lifespan=lifespan)
    app.state.service = service
    set_limits(app, connection_limits)
    install_error_handlers(app)
    app.add_middleware(RequestCounter, requests=metrics.requests, latency=metrics.latency)
    app.add_middleware(RequestContextMiddleware)  # sees every answer
    app.add_middleware(RequestIdMiddleware)  # outermost: the id is there for everything inside
    for router in routers:
        app.include_router(router)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(metrics.render(), media_type=METRICS_MEDIA_TYPE)

    document_models(app, list(documented))
    return app


def create_server_app(
    backend: GenerationBackend, settings: ServingSettings, *, title: str = "LLM server"
) -> FastAPI:
    """The ASGI app serving native and OpenAI-compatible APIs over ``backend``.

    The backend's engine starts with the app's lifespan and stops with it.
    """
    metrics = ServerMetrics(
        backend.load_report,
        backend.counters,
        settings.served_model_names[0],
        compute_path=backend.compute_path,
    )
    service = GenerationService(backend, settings, metrics)
    return build_server_app(
        title=title,
        lifecycle=backend,
        service=service,
        metrics=metrics,
        connection_limits=settings.connection_limits,
        routers=[
            build_native_router(service),
            build_openai_router(service),
            build_responses_router(service, ResponseStore(settings.max_stored_responses)),
            build_tokenize_router(service),
        ],
        documented=[
            GenerateRequest,
            CompletionRequest,
            ChatCompletionRequest,
            TokenizeRequest,
            DetokenizeRequest,
        ],
    )
