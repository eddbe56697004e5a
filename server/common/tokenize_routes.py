"""``POST /tokenize`` and ``POST /detokenize`` of a generation server, in vLLM's shapes
(``protocol.tokenize``): the ids a prompt or a conversation becomes with this server's
tokenizer and chat template, exactly as its completion routes would feed them to the model,
and ids back to text."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import ValidationError

from protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from server.common.request_context import parse_body
from server.common.service import GenerationService
from utils.errors import validation_api_error
from utils.openapi import json_body


def tokenize(service: GenerationService, body: TokenizeRequest) -> TokenizeResponse:
    """The ids of ``body``'s prompt or conversation (400 for a body that does not validate,
    an unknown model, or a conversation the template refuses)."""
    try:
        request = body.as_request()
    except ValidationError as exc:
        raise validation_api_error(exc) from None
    service.check_model(request.model)
    prompts = service.prompts
    if isinstance(request, TokenizeChatRequest):
        text = prompts.render_chat(
            request.messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=request.chat_template_kwargs,
            tools=request.tools,
        )
    else:
        text = request.prompt
    tokenizer = prompts.tokenizer
    ids = list(tokenizer.encode(text, add_special_tokens=request.add_special_tokens))
    strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=prompts.max_model_len, tokens=ids, token_strs=strs
    )


def detokenize(service: GenerationService, body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of ``body.tokens`` (400 for an id outside the vocabulary)."""
    service.check_model(body.model)
    ids = service.prompts.check_token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=service.prompts.tokenizer.decode(ids))


def build_tokenize_router(service: GenerationService) -> APIRouter:
    """``/tokenize`` and ``/detokenize`` over ``service``."""
    router = APIRouter()
    limit = service.settings.max_request_bytes

    @router.post(
        "/tokenize", response_model=TokenizeResponse, openapi_extra=json_body(TokenizeRequest)
    )
    async def tokenize_route(request: Request) -> TokenizeResponse:
        return tokenize(service, await parse_body(request, TokenizeRequest, limit))

    @router.post(
        "/detokenize",
        response_model=DetokenizeResponse,
        openapi_extra=json_body(DetokenizeRequest),
    )
    async def detokenize_route(request: Request) -> DetokenizeResponse:
        return detokenize(service, await parse_body(request, DetokenizeRequest, limit))

    return router
