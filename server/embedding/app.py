"""The embedding server's FastAPI app: ``POST /v1/embeddings``, ``GET /v1/models``,
``GET /health`` and ``GET /metrics``, with the same middleware, limits and error shape as the
generation servers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from protocol.embeddings import EmbeddingRequest, EmbeddingResponse
from protocol.health import HealthResponse
from protocol.openai_api import ModelCard, ModelList
from server.common.metrics import RequestCounter
from server.common.request_context import RequestContextMiddleware, parse_body, request_record
from server.embedding.batcher import EmbeddingBatcher
from server.embedding.config import EmbeddingServerConfig
from server.embedding.encoder import Encoder
from server.embedding.metrics import EmbeddingMetrics
from server.embedding.service import EmbeddingService, new_embedding_id
from utils.connection_limits import ConnectionLimits, set_limits
from utils.errors import install_error_handlers
from utils.openapi import document_models, json_body
from utils.request_id import RequestIdMiddleware


def create_embedding_app(
    encoder: Encoder, config: EmbeddingServerConfig, model_id: str | None = None
) -> FastAPI:
    """The ASGI app serving ``encoder`` (already loaded) as ``model_id`` (default: the
    config's served name, else the model folder's name)."""
    model_id = model_id or config.encoder_config.model_id or encoder.folder.name
    batcher = EmbeddingBatcher(encoder, config.batcher_config)
    limits = config.serving_config

    def counters() -> dict[str, float]:
        return {"embedding_batches": batcher.num_batches}

    service: EmbeddingService
    metrics = EmbeddingMetrics(lambda: service.load_report(), counters, model_id)
    service = EmbeddingService(encoder, batcher, limits, model_id, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="Embedding server", lifespan=lifespan)
    app.state.service = service
    set_limits(app, ConnectionLimits.of(limits))
    install_error_handlers(app)
    app.add_middleware(RequestCounter, requests=metrics.requests, latency=metrics.latency)
    app.add_middleware(RequestContextMiddleware)
    app.add_middleware(RequestIdMiddleware)

    @app.post(
        "/v1/embeddings",
        response_model=EmbeddingResponse,
        openapi_extra=json_body(EmbeddingRequest),
        summary="OpenAI embeddings",
    )
    async def embeddings(request: Request) -> EmbeddingResponse:
        body = await parse_body(request, EmbeddingRequest, limits.max_request_bytes)
        record = request_record(request)
        record.response_id = new_embedding_id()
        answer = await service.embed(body)
        record.num_prompt_tokens = answer.usage.prompt_tokens
        return answer

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_id, max_model_len=service.max_tokens)])

    @app.get("/health", response_model=HealthResponse)
    async def health() -> HealthResponse:
        return HealthResponse(
            kind="embedding",
            model=model_id,
            max_model_len=service.max_tokens,
            load=service.load_report(),
        )

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    document_models(app, [EmbeddingRequest])
    return app
