"""The one fake model server of the tests and benchmarks: in a thread, or as a program.

It stands in for a CB/SB model server or an OpenAI upstream: ``/health`` (a chosen model id
and load), ``/v1/models``, ``/_stats`` (its request count), and the three generation endpoints
with deterministic text (``"[<name>] w1 w2 ..."``; an *echo* server answers the prompt's words
reversed, so that another request's answer cannot pass for right), one word per SSE event. It
fails, holds or breaks streams on demand and counts what happened to them. Like a real server
it refuses (404) a model it does not serve and validates bodies with the protocol's models (400
naming the field): the gateway forwards bodies without judging them.

``start_fake_server`` serves one in a thread; ``fake_servers_args`` is the program that serves
several (port -> settings) in one process, for a test host or a deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from harness.servers import ServerThread, serve_by_port
from protocol.generation import GenerateRequest
from protocol.health import HealthResponse, LoadReport, ServerKind
from protocol.openai_api import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from utils.errors import APIError, parse_json_body
from utils.sse import SSE_HEADERS, encode_done, encode_event

_ids = itertools.count()

#: The body model of each generation endpoint.
_SCHEMAS: dict[str, type[GenerateRequest | CompletionRequest | ChatCompletionRequest]] = {
    "/generate": GenerateRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


@dataclass
class FakeServerSettings:
    """How a fake server behaves (mutable while it runs) and what it observed."""

    model_id: str | None = "fake-model"  # None: any model (an OpenAI upstream's way)
    name: str = "fake"
    kind: ServerKind = "static_batching"
    status: str = "ok"
    load: LoadReport = field(default_factory=LoadReport)
    max_model_len: int = 2048
    num_stream_events: int = 3
    stream_delay_seconds: float = 0.01
    #: When given, streams pause after their first event until the event is set.
    stream_gate: threading.Event | None = None
    #: When given, non-streaming answers wait until the event is set (or the caller leaves).
    answer_gate: threading.Event | None = None
    #: When given, streams raise after this many events (the connection breaks off).
    break_stream_after: int | None = None
    is_health_failing: bool = False
    #: When given, generation endpoints answer this HTTP status with the error shape.
    fail_status: int | None = None
    #: The error type of those answers.
    fail_type: str = "fake_error"
    #: How long those answers take (a server that fails slowly).
    fail_delay_seconds: float = 0.0
    #: Streams keep their connection open this long after ``[DONE]`` (as a busy server may).
    linger_after_done_seconds: float = 0.0
    #: When given, streams send one event, then an error event with this message (``{key}``:
    #: the caller's bearer key, as real upstreams quote it in quota errors), then end.
    stream_error_message: str | None = None
    #: Validate bodies as our servers do (off: an upstream that takes fields we do not know).
    is_validating: bool = True
    #: Like an OpenAI upstream: these bearer keys get this status (e.g. 429 for a spent key).
    fail_status_by_key: dict[str, int] = field(default_factory=dict)
    #: The Retry-After (seconds) of every error answer.
    retry_after_seconds: int = 7
    #: Answer the prompt's words reversed, paced like a model: ``stream_delay_seconds`` before
    #: every event (and per word before a whole answer), instead of the canned text.
    is_echo: bool = False
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # observations:
    #: The Authorization header of each generation request ("" when absent).
    authorizations: list[str] = field(default_factory=list)
    #: The X-Request-ID header of each generation request ("" when absent).
    request_ids: list[str] = field(default_factory=list)
    num_streams_started: int = 0
    num_streams_completed: int = 0
    num_streams_cancelled: int = 0
    num_answers_abandoned: int = 0

    def pieces(self, body: dict[str, Any] | None = None) -> list[str]:
        """The answer to ``body``, one piece per stream event."""
        if self.is_echo:
            words = echo_text(_prompt_of(body or {})).split()
            return [w if i == 0 else f" {w}" for i, w in enumerate(words)]
        return [f"[{self.name}]"] + [f" w{i}" for i in range(1, self.num_stream_events)]

    def text(self, body: dict[str, Any] | None = None) -> str:
        """The whole answer text."""
        return "".join(self.pieces(body))


def echo_text(prompt: str) -> str:
    """An echo server's answer to ``prompt``: its words reversed."""
    return " ".join(reversed(prompt.split()))


def _prompt_of(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    return messages[-1]["content"] if messages else body.get("prompt", "")


def _error(settings: FakeServerSettings, status: int, message: str, error_type: str) -> Response:
    body = {"error": {"type": error_type, "message": message, "code": status, "param": None}}
    headers = {"Retry-After": str(settings.retry_after_seconds)}
    return JSONResponse(body, status_code=status, headers=headers)


def _payloads(path: str, body: dict[str, Any], settings: FakeServerSettings) -> list[dict]:
    """The stream chunks of an answer, in the wire format of ``path``."""
    request_id = f"fake-{next(_ids)}"
    model = settings.model_id or body.get("model")
    pieces = settings.pieces(body)
    usage = {"prompt_tokens": 2, "completion_tokens": len(pieces), "total_tokens": 2 + len(pieces)}
    chunks: list[dict] = []
    for i, piece in enumerate(pieces):
        finish = "length" if i == len(pieces) - 1 else None
        if path == "/generate":
            choice: dict[str, Any] = {"index": 0, "text": piece, "finish_reason": finish}
            chunk = {"id": request_id, "model": model, "choices": [choice]}
            if finish:
                chunk["usage"] = usage
        elif path == "/v1/completions":
            choice = {"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}
            chunk = {"id": request_id, "object": "text_completion", "created": 1, "model": model}
            chunk["choices"] = [choice]
        else:
            delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            chunk = {"id": request_id, "object": "chat.completion.chunk", "created": 1}
            chunk.update(model=model, choices=[choice])
        chunks.append(chunk)
    if path != "/generate" and (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**chunks[-1], "choices": [], "usage": usage})
    return chunks


def _full_answer(path: str, body: dict[str, Any], settings: FakeServerSettings) -> dict[str, Any]:
    request_id = f"fake-{next(_ids)}"
    text, model = settings.text(body), settings.model_id or body.get("model")
    num_pieces = len(settings.pieces(body))
    usage = {"prompt_tokens": 2, "completion_tokens": num_pieces, "total_tokens": 2 + num_pieces}
    if path == "/generate":
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "length"}
        return {"id": request_id, "model": model, "choices": [choice], "usage": usage}
    if path == "/v1/completions":
        choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        obj = "text_completion"
    else:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": "length", "logprobs": None}
        obj = "chat.completion"
    answer = {"id": request_id, "object": obj, "created": 1, "model": model}
    answer.update(choices=[choice], usage=usage)
    return answer


async def _stream(chunks: list[dict], settings: FakeServerSettings) -> AsyncIterator[bytes]:
    settings.num_streams_started += 1
    is_completed = False
    try:
        for i, chunk in enumerate(chunks):
            if settings.break_stream_after is not None and i >= settings.break_stream_after:
                raise RuntimeError("fake server breaks the stream off (on purpose)")
            if i == 1 and settings.stream_gate is not None:
                while not settings.stream_gate.is_set():
                    await asyncio.sleep(0.005)
            elif i > 0 or settings.is_echo:
                await asyncio.sleep(settings.stream_delay_seconds)
            yield encode_event(chunk)
        yield encode_done()
        is_completed = True
        await asyncio.sleep(settings.linger_after_done_seconds)
    finally:
        if is_completed:
            settings.num_streams_completed += 1
        else:
            settings.num_streams_cancelled += 1


def build_fake_app(settings: FakeServerSettings) -> FastAPI:
    """A fake model server app driven by ``settings``."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        if settings.is_health_failing:
            return _error(settings, 500, "health check failing (on purpose)", "fake_error")
        report = HealthResponse(
            status=settings.status,  # type: ignore[arg-type]
            kind=settings.kind,
            model=settings.model_id,
            max_model_len=settings.max_model_len,
            load=settings.load,
        )
        return JSONResponse(report.model_dump())

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(id=settings.model_id or "", max_model_len=settings.max_model_len)
        return ModelList(data=[card])

    @app.get("/_stats")
    async def stats() -> dict[str, int]:
        return {"num_requests": len(settings.requests)}

    async def answer(request: Request) -> Response:
        path = request.url.path
        body = json.loads(await request.body())
        settings.requests.append((path, body))
        authorization = request.headers.get("authorization", "")
        settings.authorizations.append(authorization)
        settings.request_ids.append(request.headers.get("x-request-id", ""))
        if settings.is_validating:
            try:
                parse_json_body(json.dumps(body).encode(), _SCHEMAS[path])
            except APIError as exc:
                return exc.to_json_response()
        if settings.fail_status is not None:
            await asyncio.sleep(settings.fail_delay_seconds)
            message = "failing (on purpose)"
            return _error(settings, settings.fail_status, message, settings.fail_type)
        key_status = settings.fail_status_by_key.get(authorization.removeprefix("Bearer "))
        if key_status is not None:
            # Real upstreams echo (part of) the key in some errors: the gateway must scrub it.
            message = f"key {authorization.removeprefix('Bearer ')} failed (on purpose)"
            return _error(settings, key_status, message, "fake_error")
        if settings.model_id is not None and body.get("model") not in (None, "", settings.model_id):
            message = f"model {body.get('model')!r} is not served here"
            return _error(settings, 404, message, "fake_error")
        if body.get("stream"):
            chunks = _payloads(path, body, settings)
            if settings.stream_error_message is not None:
                message = settings.stream_error_message.format(key=authorization[7:])
                error = {"type": "insufficient_quota", "message": message, "code": 429}
                chunks = [chunks[0], {"error": error}]
            return StreamingResponse(
                _stream(chunks, settings), media_type="text/event-stream", headers=SSE_HEADERS
            )
        gate = settings.answer_gate
        while gate is not None and not gate.is_set():
            # What a real server must do too: notice the caller left and stop working.
            if await request.is_disconnected():
                settings.num_answers_abandoned += 1
                return Response(status_code=499)
            await asyncio.sleep(0.005)
        if settings.is_echo:  # a model computes every word before a whole answer
            await asyncio.sleep(settings.stream_delay_seconds * len(settings.pieces(body)))
        return JSONResponse(_full_answer(path, body, settings))

    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, answer, methods=["POST"])

    @app.post("/v1/rerank")
    async def rerank(request: Request) -> Response:
        """vLLM's rerank, roughly: each document's index and a made-up score."""
        body = json.loads(await request.body())
        settings.requests.append((request.url.path, body))
        documents = body.get("documents") or []
        results = [{"index": i, "relevance_score": 1.0 / (i + 1)} for i in range(len(documents))]
        return JSONResponse({"id": "rerank-1", "model": body.get("model"), "results": results})

    return app


def start_fake_server(
    settings: FakeServerSettings, sock: socket.socket | None = None
) -> ServerThread:
    """A running fake model server in a thread of this process."""
    return ServerThread(build_fake_app(settings), sock).start()


def settings_from_json(text: str) -> dict[int, FakeServerSettings]:
    """``{"port": {FakeServerSettings field: value}}`` as settings by port (``--servers``)."""
    # An unknown setting fails at once (the dataclass refuses the keyword).
    return {int(port): FakeServerSettings(**values) for port, values in json.loads(text).items()}


def fake_servers_args(host: str, servers: dict[int, dict[str, Any]]) -> list[str]:
    """The command line (after the interpreter) that serves ``servers`` as a program."""
    return ["-m", "harness.fake_server", "--host", host, "--servers", json.dumps(servers)]


def main(argv: list[str] | None = None) -> None:
    """Serve the fake servers of ``--servers`` on ``--host`` until SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--servers", required=True, help='{"port": {setting: value}}')
    args = parser.parse_args(argv)
    servers = settings_from_json(args.servers)
    serve_by_port(args.host, {port: build_fake_app(s) for port, s in servers.items()})


if __name__ == "__main__":
    main()
