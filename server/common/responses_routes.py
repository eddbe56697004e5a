"""OpenAI's Responses API on a model server: ``POST /v1/responses`` and
``GET /v1/responses/{id}``.

A request is turned into the chat request that asks the same
(:meth:`ResponsesRequest.to_chat`, after the stored conversation its
``previous_response_id`` names) and runs as one; its answer's text becomes the response's
output items: a ``reasoning`` item (a thinking model's thought), a ``message`` with its
``output_text``, and a ``function_call`` item per call, read with the same stream readers as
chat (:mod:`server.common.reasoning`, :mod:`server.common.tool_call_stream`). Streamed, the
Responses events come as the text does: ``response.created``, each item's ``added``, its text
or arguments' ``delta`` events, its ``done`` events, then ``response.completed``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from protocol.openai_api.responses_models import ResponsesRequest
from server.common.field_policy import check_unknown_fields, mark_dropped
from server.common.openai_routes import chat_job
from server.common.reasoning import ReasoningStream, is_thinking_at_start
from server.common.request_context import parse_body, request_record
from server.common.responses_store import ResponseStore, StoredResponse
from server.common.service import GenerationService, Job
from server.common.tool_call_stream import CallStreamReader
from utils.errors import APIError
from utils.http import prime, run_unless_disconnected, sse_response
from utils.openapi import json_body

ItemKind = Literal["reasoning", "message", "function_call"]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class OutputItem:
    """One output item as it grows: its text (a thought, the message, a call's arguments)."""

    kind: ItemKind
    id: str
    text: str = ""
    name: str = ""
    call_id: str = ""

    def to_object(self, status: str = "completed") -> dict[str, Any]:
        """The item in the Responses API's shape (``in_progress``: as it opens, empty)."""
        text = self.text if status == "completed" else ""
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
            return {"type": "reasoning", "id": self.id, "summary": [], "content": content}
        if self.kind == "message":
            parts = [_text_part(text)] if status == "completed" else []
            return {"type": "message", "id": self.id, "status": status, "role": "assistant",
                    "content": parts}  # fmt: skip
        return {"type": "function_call", "id": self.id, "call_id": self.call_id,
                "name": self.name, "arguments": text, "status": status}  # fmt: skip


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class OutputBuilder:
    """Reads an answer's text, piece by piece, into output items."""

    reasoning: ReasoningStream | None
    tools: CallStreamReader | None
    items: list[OutputItem] = field(default_factory=list)

    def feed(self, text: str, *, is_last: bool) -> list[tuple[OutputItem, str, bool]]:
        """What ``text`` adds: (item, its new text, whether the item is new), in order."""
        news: list[tuple[OutputItem, str, bool]] = []
        thought, content = "", text
        if self.reasoning is not None:
            part = self.reasoning.feed(text)
            if is_last:
                end = self.reasoning.finish()
                part.reasoning, part.content = (
                    part.reasoning + end.reasoning,
                    part.content + end.content,
                )
            thought, content = part.reasoning, part.content
        if thought:
            news.append(self._grow("reasoning", thought))
        if self.tools is None:
            if content:
                news.append(self._grow("message", content))
            return news
        parts = [self.tools.feed(content)] + ([self.tools.finish()] if is_last else [])
        for part in parts:
            if part.content:
                news.append(self._grow("message", part.content))
            for call in part.calls:
                if call.id is not None:
                    item = OutputItem("function_call", _new_id("fc"), name=call.name or "",
                                      call_id=call.id)  # fmt: skip
                    self.items.append(item)
                    news.append((item, call.arguments, True))
                    item.text += call.arguments
                else:
                    item = [i for i in self.items if i.kind == "function_call"][-1]
                    item.text += call.arguments
                    news.append((item, call.arguments, False))
        return news

    def _grow(self, kind: ItemKind, text: str) -> tuple[OutputItem, str, bool]:
        existing = [item for item in self.items if item.kind == kind]
        if existing:
            existing[0].text += text
            return existing[0], text, False
        item = OutputItem(kind, _new_id("rs" if kind == "reasoning" else "msg"), text=text)
        self.items.append(item)
        return item, text, True


class ResponsesApi:
    """The Responses API of one server: its store, and the answer of each request."""

    def __init__(self, service: GenerationService, store: ResponseStore) -> None:
        self.service = service
        self.store = store

    def start(self, body: ResponsesRequest, request: Request) -> tuple[Job, dict[str, Any], Any]:
        """The job, the response's opening object and the conversation it continues."""
        conversation: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            earlier = self.store.get(body.previous_response_id)
            if earlier is None:
                raise APIError(
                    404,
                    f"response {body.previous_response_id!r} is not stored here (never stored, "
                    "stored with 'store': false, or forgotten)",
                    param="previous_response_id",
                )
            conversation = list(earlier.conversation)
        conversation += body.input_messages()
        chat = body.to_chat(conversation)
        job, prompt = chat_job(self.service, chat, request_record(request))
        builder = OutputBuilder(
            ReasoningStream(is_thinking=is_thinking_at_start(prompt))
            if self.service.is_reasoning_split
            else None,
            self.service.tool_syntax.stream(is_parallel=body.parallel_tool_calls is not False)
            if chat.active_tools
            else None,
        )
        head = {
            "id": _new_id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": self.service.model_id,
            "output": [],
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": _dump(body.tool_choice) or "auto",
            "tools": [_dump(tool) for tool in body.tools or []],
            "text": _dump(body.text) or {"format": {"type": "text"}},
            "store": body.store,
            "truncation": "disabled",
            "user": body.user,
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }
        return job, head, (builder, conversation)

    def finish(
        self,
        body: ResponsesRequest,
        head: dict[str, Any],
        builder: OutputBuilder,
        conversation: list[dict[str, Any]],
        usage: tuple[int, int],
        finish_reason: str | None,
    ) -> dict[str, Any]:
        """The completed response object (stored when ``store``)."""
        num_input, num_output = usage
        is_cut = finish_reason == "length"
        response = {
            **head,
            "status": "incomplete" if is_cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if is_cut else None,
            "output": [item.to_object() for item in builder.items],
            "usage": {
                "input_tokens": num_input,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": num_output,
                "output_tokens_details": {"reasoning_tokens": self._num_reasoning(builder)},
                "total_tokens": num_input + num_output,
            },
        }
        if body.store:
            self.store.put(head["id"], StoredResponse(response, conversation + _turn(builder)))
        return response

    def _num_reasoning(self, builder: OutputBuilder) -> int:
        """The thought's tokens (its text re-encoded: the engine counts tokens, not parts)."""
        thought = "".join(item.text for item in builder.items if item.kind == "reasoning")
        return len(self.service.prompts.encode(thought, add_special_tokens=False)) if thought else 0


def _dump(value: Any) -> Any:
    return (
        value.model_dump(by_alias=True, exclude_none=True)
        if hasattr(value, "model_dump")
        else value
    )


def _turn(builder: OutputBuilder) -> list[dict[str, Any]]:
    """The answer as the conversation's assistant turn (its thought left out)."""
    content = "".join(item.text for item in builder.items if item.kind == "message")
    calls = [
        {"id": item.call_id, "type": "function",
         "function": {"name": item.name, "arguments": item.text}}
        for item in builder.items if item.kind == "function_call"
    ]  # fmt: skip
    turn: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def _event(kind: str, number: int, **data: Any) -> bytes:
    payload = orjson.dumps({"type": kind, "sequence_number": number, **data})
    return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"


async def _events(
    api: ResponsesApi, body: ResponsesRequest, job: Job, head: dict[str, Any], state: Any,
    steps: AsyncIterator[Any],
) -> AsyncIterator[bytes]:  # fmt: skip
    """The Responses events of a streamed answer."""
    builder, conversation = state
    number = 0

    def event(kind: str, **data: Any) -> bytes:
        nonlocal number
        number += 1
        return _event(kind, number - 1, **data)

    yield event("response.created", response=head)
    yield event("response.in_progress", response=head)
    num_tokens, finish_reason = 0, None
    async for deltas in steps:
        for delta in deltas:
            num_tokens += delta.num_new_tokens
            finish_reason = delta.finish_reason or finish_reason
            news = builder.feed(delta.text, is_last=delta.finish_reason is not None)
            for item, text, is_new in news:
                index = builder.items.index(item)
                if is_new:
                    yield event("response.output_item.added", output_index=index,
                                item=item.to_object("in_progress"))  # fmt: skip
                    if item.kind == "message":
                        yield event("response.content_part.added", item_id=item.id,
                                    output_index=index, content_index=0,
                                    part=_text_part(""))  # fmt: skip
                if not text:
                    continue
                kind = {
                    "message": "response.output_text.delta",
                    "reasoning": "response.reasoning_text.delta",
                    "function_call": "response.function_call_arguments.delta",
                }[item.kind]
                extra = {} if item.kind == "function_call" else {"content_index": 0}
                if item.kind == "message":
                    extra["logprobs"] = []
                yield event(kind, item_id=item.id, output_index=index, delta=text, **extra)
    for index, item in enumerate(builder.items):
        if item.kind == "message":
            yield event("response.output_text.done", item_id=item.id, output_index=index,
                        content_index=0, text=item.text, logprobs=[])  # fmt: skip
            yield event("response.content_part.done", item_id=item.id, output_index=index,
                        content_index=0, part=_text_part(item.text))  # fmt: skip
        elif item.kind == "reasoning":
            yield event("response.reasoning_text.done", item_id=item.id, output_index=index,
                        content_index=0, text=item.text)  # fmt: skip
        else:
            yield event("response.function_call_arguments.done", item_id=item.id,
                        output_index=index, name=item.name, arguments=item.text)  # fmt: skip
        yield event("response.output_item.done", output_index=index, item=item.to_object())
    usage = (job.num_prompt_tokens, num_tokens)
    response = api.finish(body, head, builder, conversation, usage, finish_reason)
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield event(kind, response=response)


def build_responses_router(service: GenerationService, store: ResponseStore) -> APIRouter:
    """``POST /v1/responses`` and ``GET /v1/responses/{id}`` over ``service``."""
    router = APIRouter(prefix="/v1")
    api = ResponsesApi(service, store)

    @router.post("/responses", openapi_extra=json_body(ResponsesRequest))
    async def create(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest, service.settings.max_request_bytes)
        dropped = check_unknown_fields(body, service.settings.unknown_fields, "/v1/responses")  # type: ignore[arg-type]
        job, head, state = api.start(body, request)
        if body.stream:
            steps = await prime(service.iter_steps(job))
            answer: Response = sse_response(_events(api, body, job, head, state, steps))
            return mark_dropped(answer, dropped)
        results = await run_unless_disconnected(request, service.collect(job))
        builder, conversation = state
        builder.feed(results[0].text, is_last=True)
        usage = (job.num_prompt_tokens, results[0].num_tokens)
        whole = api.finish(body, head, builder, conversation, usage, results[0].finish_reason)
        return mark_dropped(Response(orjson.dumps(whole), media_type="application/json"), dropped)

    @router.get("/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        entry = store.get(response_id)
        if entry is None:
            raise APIError(404, f"response {response_id!r} is not stored here")
        return Response(orjson.dumps(entry.response), media_type="application/json")

    return router
