"""Relaying an upstream Server-Sent-Events answer to the caller, chunk by chunk."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import anyio
import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from client.backends.translation import StreamTranslator
from client.metrics import Outcome, outcome_of_status
from utils.errors import APIError
from utils.sse import SSE_HEADERS, encode_event

logger = logging.getLogger(__name__)

#: Upstream headers passed back to the caller.
RETURNED_RESPONSE_HEADERS = ("retry-after", "x-request-id")


def returned_headers(response: httpx.Response) -> dict[str, str]:
    """The upstream headers the caller should see."""
    return {
        name: response.headers[name]
        for name in RETURNED_RESPONSE_HEADERS
        if name in response.headers
    }


#: The closing event of our streams and OpenAI's.
_DONE_EVENT = b"data: [DONE]"


class StreamRelay(StreamingResponse):
    """Relays an upstream stream whose first chunk was already read (the stream was primed).

    When the caller disconnects, Starlette stops the relay; closing the upstream response
    then drops the upstream connection, which is how the server learns to abort the request.
    A stream that breaks after the first chunk ends with an error event in the error shape
    (the ``openai`` SDK raises on an event carrying ``"error"``): bytes already reached the
    caller, so it is never retried. ``translator`` rewrites the upstream's chunks (a backend
    that speaks another API). ``on_close`` runs exactly once with the outcome, whether
    the stream ended, broke or was abandoned.
    """

    def __init__(
        self,
        upstream: httpx.Response,
        first_chunk: bytes,
        chunks: AsyncIterator[bytes],
        on_close: Callable[[Outcome], None],
        translator: StreamTranslator | None = None,
    ) -> None:
        self._upstream = upstream
        self._translator = translator
        self._first_chunk = first_chunk
        self._chunks = chunks
        self._on_close = on_close
        self._outcome: Outcome = "cancelled"
        self._is_closed = False
        self._relay_iterator = self._relay()
        super().__init__(
            self._relay_iterator,
            status_code=upstream.status_code,
            headers={**SSE_HEADERS, **returned_headers(upstream)},
            media_type=upstream.headers.get("content-type", "text/event-stream"),
        )

    async def _relay(self) -> AsyncGenerator[bytes, None]:
        try:
            if self._first_chunk:
                yield self._first_chunk
            async for chunk in self._chunks:
                out = self._translator.feed(chunk) if self._translator else chunk
                if out:
                    if _DONE_EVENT in out:
                        # The answer is complete: a caller that hangs up now (the openai SDK
                        # does as soon as it reads [DONE]) got all of it.
                        self._outcome = outcome_of_status(self._upstream.status_code)
                    yield out
            if self._translator is not None and (tail := self._translator.close()):
                yield tail
        except httpx.HTTPError as exc:
            is_timeout = isinstance(exc, httpx.TimeoutException)
            self._outcome = "timeout" if is_timeout else "upstream_broken"
            logger.warning("stream from %s broke off: %r", self._upstream.url, exc)
            error = (
                APIError(504, "the model server stopped sending in time")
                if is_timeout
                else APIError(502, f"the model server's stream broke off ({type(exc).__name__})")
            )
            event = encode_event(error.to_response().model_dump())
            yield self._translator.error_event(event) if self._translator else event
            return
        self._outcome = outcome_of_status(self._upstream.status_code)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()

    async def _close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        self._on_close(self._outcome)
        # Shielded: this also runs when the request task is being cancelled, and an unclosed
        # upstream response would keep the server generating for nobody.
        with anyio.CancelScope(shield=True):
            await self._relay_iterator.aclose()
            await self._upstream.aclose()
