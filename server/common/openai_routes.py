"""OpenAI-compatible API of a model server: completions, chat completions, model list."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from protocol.generation import GenerationConfig
from protocol.openai_api import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from protocol.structured_outputs import StructuredOutputs
from server.common.answers import AnswerShape, answer_job
from server.common.chat_shape import CHAT, chat_with_tools, with_reasoning
from server.common.completion_shape import Echo, EchoedPrompt, completion_shape
from server.common.field_policy import check_unknown_fields, mark_dropped
from server.common.reasoning import is_thinking_at_start
from server.common.request_context import RequestRecord, parse_body, request_record
from server.common.service import GenerationService, Job, new_response_id
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
        service.prompts.check_token_ids(p)
        if isinstance(p, list)
        else service.prompts.encode(p, add_special_tokens=body.add_special_tokens is not False)
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


def chat_job(
    service: GenerationService, body: ChatCompletionRequest, record: RequestRecord
) -> tuple[Job, str]:
    """The job of a chat request, and its rendered prompt ("" for a resumed stream)."""
    service.check_model(body.model)
    config = _generation_config(body)
    tools = body.active_tools
    forced = body.forced_function
    if forced is not None:  # required, or a named function: the output is calls alone
        if config.output_grammar is not None:
            raise APIError(
                400,
                "a forced tool call ('tool_choice' required or a named function) constrains "
                "the output itself; it cannot be combined with 'response_format' or "
                "'structured_outputs'",
                param="tool_choice",
            )
        # A named function is called once (as OpenAI and vLLM do); required, once or more.
        is_parallel = not forced and body.parallel_tool_calls is not False
        grammar = service.tool_syntax.grammar(tools, forced or None, is_parallel=is_parallel)
        config.structured_outputs = StructuredOutputs(grammar=grammar)
    if tools and service.tool_syntax.is_special_kept:
        config.skip_special_tokens = False  # the calls' marker is a special token
    if body.resume is not None:
        return service.make_resumed_job(body.resume, config, record), ""
    prompt = service.prompts.render_chat(
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        template_kwargs=body.template_kwargs,
        tools=tools,
    )
    token_ids = service.prompts.encode(prompt, add_special_tokens=bool(body.add_special_tokens))
    token_ids = service.prompts.truncate(token_ids, body.truncate_prompt_tokens)
    return service.make_job(new_response_id("chatcmpl"), [token_ids], config, record), prompt


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
        job, prompt = chat_job(service, body, request_record(request))
        shape = CHAT
        if body.active_tools:
            is_parallel = body.parallel_tool_calls is not False
            shape = chat_with_tools(service.tool_syntax, is_parallel=is_parallel)
        if service.is_reasoning_split:
            thinking = is_thinking_at_start(prompt)
            shape = with_reasoning(shape, is_thinking=thinking, is_included=body.include_reasoning)
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
