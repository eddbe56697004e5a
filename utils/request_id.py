"""Request ids end to end: every HTTP request gets one (the caller's ``X-Request-ID`` when it
sent a sane one), the app reads it from ``request.state.request_id`` for its logs, and every
answer carries it back in ``X-Request-ID``, errors included."""

from __future__ import annotations

import uuid

from starlette.types import Message, Receive, Scope, Send

from utils.asgi import HttpMiddleware

REQUEST_ID_HEADER = "x-request-id"
#: Longer ids, or ids with characters outside printable ASCII, are replaced (they end up in
#: log lines and headers).
MAX_REQUEST_ID_CHARS = 128


def sane_request_id(value: str | None) -> str | None:
    """``value`` when it is usable as a request id (1-128 printable ASCII characters, no
    spaces), else None."""
    if not value or len(value) > MAX_REQUEST_ID_CHARS:
        return None
    if not all("!" <= char <= "~" for char in value):
        return None
    return value


def new_request_id() -> str:
    """A fresh request id, for a request that came without a usable one."""
    return uuid.uuid4().hex


class RequestIdMiddleware(HttpMiddleware):
    """ASGI middleware giving each HTTP request an id and returning it in the answer."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Give the request its id (in ``scope["state"]``) and put it in the answer's headers."""
        header = REQUEST_ID_HEADER.encode()
        sent = next((v for k, v in scope.get("headers", []) if k.lower() == header), None)
        request_id = sane_request_id(sent.decode("latin-1") if sent else None)
        request_id = request_id or new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != header]
                headers.append((header, request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id_of(state: object) -> str:
    """The id the middleware gave the request (``request.state``); a fresh one without it."""
    return getattr(state, "request_id", None) or new_request_id()
