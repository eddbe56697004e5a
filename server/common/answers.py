"""The HTTP answer of a job, in one API's shape: its Server-Sent Events (with the comment lines
that let the gateway resume a broken stream, ``protocol.resume``), or the whole answer."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from protocol.resume import STREAM_COMMENT, STREAM_TOKENS_HEADER, TOKENS_COMMENT
from server.common.backend import TextDelta
from server.common.service import ChoiceResult, GenerationService, Job
from utils.http import prime, run_unless_disconnected, sse_response
from utils.sse import ChunkEncoder, encode_event

#: A choice's part of one stream event, from its delta and whether the choice has had no event
#: yet; None when the delta has nothing to show (the choice stays out of the event).
ChoiceEncoder = Callable[[TextDelta, bool], dict[str, Any] | None]


async def stream_events(
    job: Job,
    model_id: str,
    steps: AsyncIterator[list[TextDelta]],
    envelope: Callable[..., BaseModel],
    choice_of: ChoiceEncoder,
    is_usage_streamed: bool,
    is_tracked: bool = False,
    opening_fields: dict[str, Any] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE events of ``job`` in one API's shape: one per step (every choice ``choice_of``
    shows), then, if ``is_usage_streamed``, one with no choices and the usage.

    ``envelope`` is that API's chunk model (``GenerateStreamChunk``, ``CompletionResponse``,
    ``ChatCompletionChunk``), called with ``id``, ``model``, ``choices`` (and ``usage``); the
    step events reuse its serialised form (``ChunkEncoder``) and only encode their choices.
    ``is_tracked`` (the gateway asked, the stream can be resumed) adds ``protocol.resume``'s
    comment lines: the prompt's ids first, then each event's token ids and text length.
    ``opening_fields`` go into the envelope of the first event with choices only.
    """
    num_tokens = 0
    opened = set(job.opened_choices)
    extra = {"created": job.created} if job.created is not None else {}
    head = envelope(id=job.request_id, model=model_id, choices=[], **extra)
    encoder = ChunkEncoder(head)
    first_encoder = encoder
    if opening_fields:
        opening_head = envelope(
            id=job.request_id, model=model_id, choices=[], **extra, **opening_fields
        )
        first_encoder = ChunkEncoder(opening_head)
    if is_tracked:
        opening = {
            "id": job.request_id,
            "created": getattr(head, "created", None),
            "prompt_token_ids": job.sequences[0].prompt_token_ids,
        }
        yield STREAM_COMMENT + orjson.dumps(opening) + b"\n\n"
    async for deltas in steps:
        choices: list[dict[str, Any]] = []
        tokens: dict[str, list[Any]] = {}
        for delta in deltas:
            num_tokens += delta.num_new_tokens
            choice = choice_of(delta, delta.index not in opened)
            if choice is not None:
                opened.add(delta.index)
                choices.append(choice)
            if is_tracked and (delta.token_ids or delta.text):
                ids, num_chars = tokens.setdefault(str(delta.index), [[], 0])
                ids.extend(delta.token_ids)
                tokens[str(delta.index)][1] = num_chars + (len(delta.text) if choice else 0)
        comment = TOKENS_COMMENT + orjson.dumps(tokens) + b"\n" if tokens else b""
        if choices:
            yield comment + first_encoder.encode(choices)
            first_encoder = encoder
        elif comment:
            yield comment + b"\n"
    if is_usage_streamed:
        usage = job.usage(num_tokens)
        yield encode_event(
            envelope(id=job.request_id, model=model_id, choices=[], usage=usage, **extra)
        )


@dataclass(frozen=True)
class AnswerShape:
    """How one API words a job's answer: its stream chunk model with the encoder of a choice's
    part of a chunk, and its whole-answer model with the model of one finished choice."""

    chunk: Callable[..., BaseModel]
    chunk_choice: ChoiceEncoder
    response: Callable[..., BaseModel]
    response_choice: Callable[[ChoiceResult], BaseModel]
    #: False when a stream's text is not the deltas' text as they come (tool calls read at
    #: the end, an echoed prompt): another server could not take it over from the ids.
    is_resumable: bool = True
    #: Top-level fields of a stream's first event with choices only.
    opening_fields: dict[str, Any] = field(default_factory=dict)


async def answer_job(
    request: Request,
    service: GenerationService,
    job: Job,
    shape: AnswerShape,
    *,
    is_stream: bool,
    is_usage_streamed: bool,
) -> Response:
    """The HTTP answer of ``job`` in ``shape``: a primed SSE stream (at most one event per
    step, then the usage event if ``is_usage_streamed``; errors before the first token still
    get a JSON error status), or the whole answer once every choice is done (cancelled if the
    caller goes away first)."""
    if is_stream:
        steps = await prime(service.iter_steps(job))
        is_tracked = (
            request.headers.get(STREAM_TOKENS_HEADER) == "1"
            and job.is_resumable
            and shape.is_resumable
        )
        return sse_response(
            stream_events(
                job,
                service.model_id,
                steps,
                shape.chunk,
                shape.chunk_choice,
                is_usage_streamed,
                is_tracked,
                shape.opening_fields,
            )
        )
    results = await run_unless_disconnected(request, service.collect(job))
    extra = {"created": job.created} if job.created is not None else {}
    whole = shape.response(
        **extra,
        id=job.request_id,
        model=service.model_id,
        choices=[shape.response_choice(r) for r in results],
        usage=job.usage(sum(r.num_tokens for r in results)),
    )
    return Response(whole.model_dump_json(), media_type="application/json")
