"""One HTTP request as the server sees it: its id, its body parsed once, its closing log line.

The gateway sends ``X-Request-ID``; ``utils.request_id`` keeps a usable one (else makes one
up) and returns it in the answer's ``X-Request-ID`` header (streams too). Here it starts the
one INFO line logged when a POST request finishes: endpoint, status, response id, prompt and
completion tokens, finish reasons or the error, and duration.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from protocol.generation import FinishReason
from utils.asgi import HttpMiddleware
from utils.errors import parse_json_body
from utils.http import read_body
from utils.request_id import new_request_id

_MAX_ERROR_BODY_BYTES = 4096  # error answers are one small JSON object

logger = logging.getLogger(__name__)

BodyT = TypeVar("BodyT", bound=BaseModel)


@dataclass
class RequestRecord:
    """What the closing log line of one request says; the routes and the service fill it in."""

    request_id: str
    endpoint: str
    start_time: float = field(default_factory=time.monotonic)
    response_id: str | None = None
    num_choices: int = 0
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    finish_reasons: dict[int, FinishReason] = field(default_factory=dict)
    status: int | None = None
    error: str | None = None

    def summary(self) -> str:
        """The log line (without the logger's prefix)."""
        reasons = [self.finish_reasons[i] for i in sorted(self.finish_reasons)]
        error = self.error
        if error is None and self.status == 200 and len(reasons) < self.num_choices:
            error = "ended before every choice finished (client gone?)"
        parts = [
            f"request_id={_quoted(self.request_id)}",
            f"endpoint={self.endpoint}",
            f"status={self.status}",
            f"id={self.response_id or '-'}",
            f"prompt_tokens={self.num_prompt_tokens}",
            f"completion_tokens={self.num_completion_tokens}",
            f"finish={','.join(reasons) or '-'}",
            f"duration={time.monotonic() - self.start_time:.3f}s",
        ]
        if error is not None:
            parts.append(f"error={json.dumps(error)}")
        return " ".join(parts)


def _quoted(value: str) -> str:
    """``value`` as one token of a ``key=value`` log line."""
    return json.dumps(value) if not value or any(c in value for c in ' "=') else value


def request_record(request: Request) -> RequestRecord:
    """The record ``RequestContextMiddleware`` attached (a detached one without it)."""
    record = getattr(request.state, "record", None)
    if record is None:
        record = RequestRecord(new_request_id(), request.url.path)
        request.state.record = record
    return record


async def parse_body(request: Request, schema: type[BodyT], max_bytes: int) -> BodyT:
    """Validate the raw body straight into ``schema``: pydantic parses the JSON itself, so the
    request never exists as a dict; 400 naming the problem otherwise, 413 past ``max_bytes``
    (a chunked body without Content-Length is read up to the limit, then refused)."""
    return parse_json_body(await read_body(request, max_bytes), schema)


def _error_message(body: bytes) -> str | None:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:200] or None


class RequestContextMiddleware(HttpMiddleware):
    """Pure ASGI (streaming and disconnects intact): one log line per finished POST, under
    the id that ``utils.request_id.RequestIdMiddleware`` (installed outside this one) gave
    the request and returns in the answer."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Record the request while it runs; log its line when it ends."""
        state = scope.setdefault("state", {})
        record = RequestRecord(state.get("request_id") or new_request_id(), scope["path"])
        state["record"] = record
        error_body = bytearray()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body" and (record.status or 0) >= 400:
                error_body.extend(message.get("body", b"")[:_MAX_ERROR_BODY_BYTES])
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # answered 500 by the outermost middleware
            record.status = record.status or 500
            record.error = record.error or f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if record.error is None and error_body:
                record.error = _error_message(bytes(error_body))
            if scope["method"] == "POST":
                logger.info("%s", record.summary())
