"""OpenAI-compatible API of a model server: completions, chat completions, model list."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from protocol.generation import GenerationConfig
from protocol.openai_api import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from server.common.backend import TextDelta
from server.common.request_context import RequestRecord, parse_body, request_record
from server.common.service import (
    AnswerShape,
    GenerationService,
    Job,
    answer_job,
    new_response_id,
)
from utils.errors import APIError, validation_api_error
from utils.openapi import json_body


def _generation_config(body: CompletionRequest | ChatCompletionRequest) -> GenerationConfig:
    try:
        return body.to_generation_config()
    except ValidationError as exc:
        raise validation_api_error(exc) from None


def _completion_job(
    service: GenerationService, body: CompletionRequest, record: RequestRecord
) -> Job:
    service.check_model(body.model)
    config = _generation_config(body)
    if body.echo:
        raise APIError(400, "'echo' is not supported", param="echo")
    prompts = [
        service.prompts.check_token_ids(p) if isinstance(p, list) else service.prompts.encode(p)
        for p in body.prompts()
    ]
    return service.make_job(new_response_id("cmpl"), prompts, config, record)


def _chat_job(
    service: GenerationService, body: ChatCompletionRequest, record: RequestRecord
) -> Job:
    service.check_model(body.model)
    config = _generation_config(body)
    prompt = service.prompts.render_chat(
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        template_kwargs=body.chat_template_kwargs,
    )
    token_ids = service.prompts.encode(prompt, is_chat=True)
    return service.make_job(new_response_id("chatcmpl"), [token_ids], config, record)


def _completion_choice(delta: TextDelta, is_opening: bool) -> dict[str, Any] | None:
    """A choice's part of a completion stream chunk (a ``CompletionChoice``), when it has
    news."""
    if not delta.text and delta.finish_reason is None:
        return None
    return {
        "index": delta.index,
        "text": delta.text,
        "finish_reason": delta.finish_reason,
        "logprobs": None,
    }


def _chat_choice(delta: TextDelta, is_opening: bool) -> dict[str, Any] | None:
    """A choice's part of a chat chunk (a ``ChatCompletionChunkChoice``): its new text and,
    once it ends, its finish reason; None when it has no news and is already open.

    OpenAI opens every choice with the assistant role; here the role rides on the choice's
    first delta (as OpenAI-compatible servers such as llama.cpp's do) rather than costing an
    event of its own.
    """
    if not is_opening and not delta.text and delta.finish_reason is None:
        return None
    chat_delta = (
        {"role": "assistant", "content": delta.text}
        if is_opening
        else {"role": None, "content": delta.text or None}
    )
    return {
        "index": delta.index,
        "delta": chat_delta,
        "finish_reason": delta.finish_reason,
        "logprobs": None,
    }


_COMPLETION = AnswerShape(
    chunk=CompletionResponse,
    chunk_choice=_completion_choice,
    response=CompletionResponse,
    response_choice=lambda r: CompletionChoice(
        index=r.index, text=r.text, finish_reason=r.finish_reason
    ),
)

_CHAT = AnswerShape(
    chunk=ChatCompletionChunk,
    chunk_choice=_chat_choice,
    response=ChatCompletionResponse,
    response_choice=lambda r: ChatCompletionChoice(
        index=r.index, message=ChatResponseMessage(content=r.text), finish_reason=r.finish_reason
    ),
)


def build_openai_router(service: GenerationService) -> APIRouter:
    """Routes of the OpenAI-compatible API over ``service``."""
    router = APIRouter(prefix="/v1")

    @router.post(
        "/completions",
        response_model=CompletionResponse,
        openapi_extra=json_body(CompletionRequest),
    )
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, service.settings.max_request_bytes)
        job = _completion_job(service, body, request_record(request))
        return await answer_job(
            request,
            service,
            job,
            _COMPLETION,
            is_stream=body.stream,
            is_usage_streamed=body.is_usage_streamed,
        )

    @router.post(
        "/chat/completions",
        response_model=ChatCompletionResponse,
        openapi_extra=json_body(ChatCompletionRequest),
    )
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, service.settings.max_request_bytes)
        job = _chat_job(service, body, request_record(request))
        return await answer_job(
            request,
            service,
            job,
            _CHAT,
            is_stream=body.stream,
            is_usage_streamed=body.is_usage_streamed,
        )

    @router.get("/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, max_model_len=service.backend.max_model_len)
                for name in service.settings.served_model_names
            ]
        )

    return router
