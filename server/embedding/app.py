"""The embedding server's FastAPI app: ``POST /v1/embeddings``, ``GET /v1/models``,
``GET /health`` and ``GET /metrics``, built by ``server.common.app.build_server_app`` like the
generation servers' (same lifespan, middleware, limits, error shape and metrics plumbing)."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request

from protocol.embeddings import EmbeddingRequest, EmbeddingResponse
from protocol.health import HealthResponse
from protocol.openai_api import ModelCard, ModelList
from server.common.app import build_server_app
from server.common.metrics import EmbeddingMetrics
from server.common.request_context import parse_body, request_record
from server.embedding.batcher import EmbeddingBatcher
from server.embedding.config import EmbeddingServerConfig
from server.embedding.encoder import Encoder
from server.embedding.service import EmbeddingService, new_embedding_id
from utils.openapi import json_body


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
    return build_server_app(
        title="Embedding server",
        lifecycle=service,
        service=service,
        metrics=metrics,
        connection_limits=limits.connection_limits,
        routers=[build_embedding_router(service)],
        documented=[EmbeddingRequest],
    )


def build_embedding_router(service: EmbeddingService) -> APIRouter:
    """The embedding server's own routes over ``service``."""
    router = APIRouter()

    @router.post(
        "/v1/embeddings",
        response_model=EmbeddingResponse,
        openapi_extra=json_body(EmbeddingRequest),
        summary="OpenAI embeddings",
    )
    async def embeddings(request: Request) -> EmbeddingResponse:
        body = await parse_body(request, EmbeddingRequest, service.limits.max_request_bytes)
        record = request_record(request)
        record.response_id = new_embedding_id()
        answer = await service.embed(body)
        record.num_prompt_tokens = answer.usage.prompt_tokens
        return answer

    @router.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=service.model_id, max_model_len=service.max_tokens)])

    @router.get("/health", response_model=HealthResponse)
    async def health() -> HealthResponse:
        return HealthResponse(
            kind="embedding",
            model=service.model_id,
            max_model_len=service.max_tokens,
            load=service.load_report(),
        )

    return router
