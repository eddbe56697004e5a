"""OpenAI-compatible API of a model server: completions, chat completions, model list."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from protocol.generation import GenerationConfig, TokenLogprob, TopLogprob
from protocol.openai_api import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionRequest,
    CompletionResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    ToolCall,
)
from server.common.answers import AnswerShape, answer_job
from server.common.backend import TextDelta
from server.common.completion_shape import Echo, EchoedPrompt, completion_shape
from server.common.field_policy import check_unknown_fields, mark_dropped
from server.common.request_context import RequestRecord, parse_body, request_record
from server.common.service import ChoiceResult, GenerationService, Job, new_response_id
from server.common.tool_calls import call_schema, parse_tool_calls
from server.common.vllm_answer_fields import with_prompt_logprobs, with_token_ids
from utils.errors import APIError, validation_api_error
from utils.openapi import json_body


def _generation_config(body: CompletionRequest | ChatCompletionRequest) -> GenerationConfig:
    try:
        return body.to_generation_config()
    except ValidationError as exc:
        raise validation_api_error(exc) from None


def _completion_job(
    service: GenerationService, body: CompletionRequest, record: RequestRecord
) -> tuple[Job, Echo | None]:
    """The job of a completions request, and what it echoes (None without ``echo``)."""
    service.check_model(body.model)
    config = _generation_config(body)
    if body.resume is not None:  # the prompt was echoed before the switch
        return service.make_resumed_job(body.resume, config, record), None
    texts = body.prompts()
    prompts = [
        service.prompts.check_token_ids(p) if isinstance(p, list) else service.prompts.encode(p)
        for p in texts
    ]
    if body.truncate_prompt_tokens is not None:
        prompts = [service.prompts.truncate(p, body.truncate_prompt_tokens) for p in prompts]
        texts = list(prompts)  # an echo shows what the model was given
    job = service.make_job(new_response_id("cmpl"), prompts, config, record)
    if not body.echo:
        return job, None
    tokenizer = service.prompts.tokenizer
    echoed = [
        EchoedPrompt(
            text=text if isinstance(text, str) else tokenizer.decode(ids),
            first_token=tokenizer.decode(ids[:1], skip_special_tokens=False),
        )
        for text, ids in zip(texts, prompts, strict=True)
    ]
    if body.is_echo_only:
        job.is_output_dropped = True
    return job, Echo(echoed, job.num_choices_per_sequence, is_prompt_only=body.is_echo_only)


def _chat_job(
    service: GenerationService, body: ChatCompletionRequest, record: RequestRecord
) -> Job:
    service.check_model(body.model)
    config = _generation_config(body)
    tools = body.active_tools
    forced = body.forced_function
    if forced is not None:  # required, or a named function: the output is one call
        if config.output_grammar is not None:
            raise APIError(
                400,
                "a forced tool call ('tool_choice' required or a named function) constrains "
                "the output itself; it cannot be combined with 'response_format' or "
                "'structured_outputs'",
                param="tool_choice",
            )
        config.json_schema = call_schema(tools, forced or None)
    if body.resume is not None:
        return service.make_resumed_job(body.resume, config, record)
    prompt = service.prompts.render_chat(
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        template_kwargs=body.chat_template_kwargs,
        tools=tools,
    )
    token_ids = service.prompts.encode(prompt, is_chat=True)
    token_ids = service.prompts.truncate(token_ids, body.truncate_prompt_tokens)
    return service.make_job(new_response_id("chatcmpl"), [token_ids], config, record)


def _chat_top(entry: TopLogprob | TokenLogprob) -> dict[str, Any]:
    """OpenAI's ``{token, logprob, bytes}`` of one token (``bytes``: its text's UTF-8)."""
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode("utf-8")),
    }


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` (``ChatLogprobs``) of these tokens; None when not asked."""
    if entries is None:
        return None
    return {
        "content": [
            {**_chat_top(e), "top_logprobs": [_chat_top(t) for t in e.top_logprobs]}
            for e in entries
        ]
    }


def _chat_choice(delta: TextDelta, is_opening: bool) -> dict[str, Any] | None:
    """A choice's part of a chat chunk (a ``ChatCompletionChunkChoice``): its new text (and
    its new tokens' logprobs) and, once it ends, its finish reason; None when it has no news
    and is already open.

    OpenAI opens every choice with the assistant role; here the role rides on the choice's
    first delta (as OpenAI-compatible servers such as llama.cpp's do) rather than costing an
    event of its own.
    """
    if not is_opening and not delta.text and delta.finish_reason is None and not delta.logprobs:
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
        "logprobs": chat_logprobs(delta.logprobs),
    }


def _chat_logprobs_model(entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
    """A whole answer's ``ChatLogprobs`` of a choice's tokens; None when not asked."""
    logprobs = chat_logprobs(entries)
    return None if logprobs is None else ChatLogprobs.model_validate(logprobs)


def _chat_response_choice(r: ChoiceResult) -> ChatCompletionChoice:
    return ChatCompletionChoice(
        index=r.index,
        message=ChatResponseMessage(content=r.text),
        finish_reason=r.finish_reason,
        logprobs=_chat_logprobs_model(r.logprobs),
    )


_CHAT = AnswerShape(
    chunk=ChatCompletionChunk,
    chunk_choice=_chat_choice,
    response=ChatCompletionResponse,
    response_choice=_chat_response_choice,
)


def _chat_with_tools(is_constrained: bool) -> AnswerShape:
    """The chat shape when the model may call tools: each choice's text is read for calls
    once it is complete (a call cannot be told from text before), so a stream sends a choice
    in one event when it finishes: content, or ``tool_calls`` with ``finish_reason``
    ``tool_calls``, as OpenAI streams them (the SDK assembles either)."""
    texts: dict[int, list[str]] = {}
    entries: dict[int, list[TokenLogprob]] = {}

    def message_of(text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = parse_tool_calls(text, is_constrained=is_constrained)
        return content, [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls
        ]

    def chunk_choice(delta: TextDelta, is_opening: bool) -> dict[str, Any] | None:
        texts.setdefault(delta.index, []).append(delta.text)
        if delta.logprobs is not None:
            entries.setdefault(delta.index, []).extend(delta.logprobs)
        if delta.finish_reason is None:
            return None
        content, calls = message_of("".join(texts.pop(delta.index)))
        chat_delta: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            chat_delta["tool_calls"] = [
                {"index": i, **call.model_dump()} for i, call in enumerate(calls)
            ]
        return {
            "index": delta.index,
            "delta": chat_delta,
            "finish_reason": "tool_calls" if calls else delta.finish_reason,
            "logprobs": chat_logprobs(entries.pop(delta.index, None)),
        }

    def response_choice(result: ChoiceResult) -> ChatCompletionChoice:
        content, calls = message_of(result.text)
        return ChatCompletionChoice(
            index=result.index,
            message=ChatResponseMessage(content=content, tool_calls=calls or None),
            finish_reason="tool_calls" if calls else result.finish_reason,
            logprobs=_chat_logprobs_model(result.logprobs),
        )

    return AnswerShape(
        chunk=ChatCompletionChunk,
        chunk_choice=chunk_choice,
        response=ChatCompletionResponse,
        response_choice=response_choice,
        is_resumable=False,
    )


async def _answer(
    request: Request,
    service: GenerationService,
    job: Job,
    shape: AnswerShape,
    body: CompletionRequest | ChatCompletionRequest,
) -> Response:
    """The job's answer in ``shape``: a stream when the body asks one, with a usage chunk at
    its end when ``stream_options.include_usage`` asks that."""
    return await answer_job(
        request,
        service,
        job,
        shape,
        is_stream=body.stream,
        is_usage_streamed=body.is_usage_streamed,
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
        dropped = check_unknown_fields(body, service.settings.unknown_fields, "/v1/completions")
        job, echo = _completion_job(service, body, request_record(request))
        shape = completion_shape(echo)
        if body.return_token_ids:
            shape = with_token_ids(shape, job, is_chat=False)
        if body.prompt_logprobs is not None:
            shape = with_prompt_logprobs(shape, is_chat=False)
        answer = await _answer(request, service, job, shape, body)
        return mark_dropped(answer, dropped)

    @router.post(
        "/chat/completions",
        response_model=ChatCompletionResponse,
        openapi_extra=json_body(ChatCompletionRequest),
    )
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, service.settings.max_request_bytes)
        policy = service.settings.unknown_fields
        dropped = check_unknown_fields(body, policy, "/v1/chat/completions")
        job = _chat_job(service, body, request_record(request))
        shape = _CHAT
        if body.active_tools:
            shape = _chat_with_tools(is_constrained=body.forced_function is not None)
        if body.return_token_ids:
            shape = with_token_ids(shape, job, is_chat=True)
        if body.prompt_logprobs is not None:
            shape = with_prompt_logprobs(shape, is_chat=True)
        return mark_dropped(await _answer(request, service, job, shape, body), dropped)

    @router.get("/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, max_model_len=service.backend.max_model_len)
                for name in service.settings.served_model_names
            ]
        )

    return router
