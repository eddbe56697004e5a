"""Builds the FastAPI app of a model server around any ``GenerationBackend``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from protocol.generation import GenerateRequest
from protocol.openai_api import ChatCompletionRequest, CompletionRequest
from server.common.backend import GenerationBackend
from server.common.metrics import RequestCounter, ServerMetrics
from server.common.native_routes import build_native_router
from server.common.openai_routes import build_openai_router
from server.common.request_context import RequestContextMiddleware
from server.common.service import GenerationService, ServingSettings
from utils.connection_limits import set_limits
from utils.errors import install_error_handlers
from utils.openapi import document_models
from utils.request_id import RequestIdMiddleware


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

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.shutdown()

    app = FastAPI(title=title, lifespan=lifespan)
    app.state.service = service
    set_limits(app, settings.connection_limits)
    install_error_handlers(app)
    app.add_middleware(RequestCounter, requests=metrics.requests)
    app.add_middleware(RequestContextMiddleware)  # sees every answer
    app.add_middleware(RequestIdMiddleware)  # outermost: the id is there for everything inside
    app.include_router(build_native_router(service))
    app.include_router(build_openai_router(service))
    document_models(app, [GenerateRequest, CompletionRequest, ChatCompletionRequest])
    return app
