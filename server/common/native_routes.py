"""Native API of a model server: ``POST /generate`` and ``GET /health`` (``GET /metrics`` is
every server's: ``server.common.app``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from protocol.generation import (
    Choice,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamChunk,
)
from protocol.health import HealthResponse
from server.common.answers import AnswerShape, answer_job
from server.common.backend import TextDelta
from server.common.request_context import RequestRecord, parse_body, request_record
from server.common.service import GenerationService, Job, new_response_id
from utils.openapi import json_body


def _native_job(service: GenerationService, body: GenerateRequest, record: RequestRecord) -> Job:
    service.check_model(body.model)
    if body.resume is not None:
        return service.make_resumed_job(body.resume, body.generation_config, record)
    if body.messages is not None:
        prompt = service.prompts.render_chat(body.messages)
        token_ids = service.prompts.encode(prompt, add_special_tokens=False)
    else:
        token_ids = service.prompts.encode(body.prompt or "")
    return service.make_job(new_response_id("gen"), [token_ids], body.generation_config, record)


def _native_choice(delta: TextDelta, is_opening: bool) -> dict[str, Any] | None:
    """A choice's part of a ``/generate`` stream event (a ``Choice``), when it has news (text,
    its end, or the logprobs of new tokens whose text is still held back)."""
    has_news = delta.text or delta.finish_reason is not None or delta.logprobs
    if not has_news and delta.prompt_logprobs is None:
        return None
    choice: dict[str, Any] = {
        "index": delta.index,
        "text": delta.text,
        "finish_reason": delta.finish_reason,
    }
    if delta.logprobs is not None:
        choice["logprobs"] = [entry.model_dump() for entry in delta.logprobs]
    if delta.prompt_logprobs is not None:
        choice["prompt_logprobs"] = [entry.model_dump() for entry in delta.prompt_logprobs]
    return choice


_NATIVE = AnswerShape(
    chunk=GenerateStreamChunk,
    chunk_choice=_native_choice,
    response=GenerateResponse,
    response_choice=lambda r: Choice(
        index=r.index,
        text=r.text,
        finish_reason=r.finish_reason,
        logprobs=r.logprobs,
        prompt_logprobs=r.prompt_logprobs,
    ),
)


def build_native_router(service: GenerationService) -> APIRouter:
    """Routes of the native API over ``service``."""
    router = APIRouter()

    @router.post(
        "/generate", response_model=GenerateResponse, openapi_extra=json_body(GenerateRequest)
    )
    async def generate(request: Request) -> Response:
        body = await parse_body(request, GenerateRequest, service.settings.max_request_bytes)
        job = _native_job(service, body, request_record(request))
        # The native stream always ends with its usage event.
        return await answer_job(
            request, service, job, _NATIVE, is_stream=body.stream, is_usage_streamed=True
        )

    @router.get("/health", response_model=HealthResponse)
    async def health() -> HealthResponse:
        backend = service.backend
        return HealthResponse(
            kind=backend.kind,
            model=service.model_id,
            max_model_len=backend.max_model_len,
            load=backend.load_report(),
            compute=backend.compute_path,
        )

    return router
