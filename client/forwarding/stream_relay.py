"""Relaying an upstream Server-Sent-Events answer to the caller, chunk by chunk, and going on
from another server when a resumable stream breaks off (``client.forwarding.resume``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import anyio
import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from client.backends.backend import Backend
from client.backends.lease import InFlightLease
from client.backends.translation import StreamTranslator
from client.forwarding.stream_tokens import StreamTokens
from client.metrics import Outcome, ResumeCause, outcome_of_status
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


@dataclass
class UpstreamStream:
    """One backend's stream, primed: its first chunk read, the rest to come. ``on_close``
    gives the attempt's verdict once, with whether the caller's request is over too."""

    backend: Backend
    lease: InFlightLease
    response: httpx.Response
    first_chunk: bytes
    chunks: AsyncIterator[bytes]
    on_close: Callable[[Outcome, bool], None]


class Resumer(Protocol):
    """Finds another server to finish a broken stream (``client.forwarding.resume``)."""

    async def resume(
        self, cause: ResumeCause, broken: UpstreamStream
    ) -> UpstreamStream | bytes | None:
        """The stream that goes on, bytes that end the answer (nothing was left to
        generate), or None when the stream cannot go on."""


class _Abandoned(Exception):
    """Heartbeats marked the streaming server down while the relay waited for it."""


class StreamRelay(StreamingResponse):
    """Relays an upstream stream whose first chunk was already read (the stream was primed).

    When the caller disconnects, Starlette stops the relay; closing the upstream response
    then drops the upstream connection, which is how the server learns to abort the request.
    A stream that breaks after the first chunk ends with an error event in the error shape
    (the ``openai`` SDK raises on an event carrying ``"error"``), unless it is tracked
    (``tracker``: one of our servers streams its token ids) and a :attr:`resumer` finds
    another server to finish it: the caller then sees one unbroken answer. A tracked stream
    whose server heartbeats mark down is treated as broken at once (a black-holed host sends
    no reset). ``translator`` rewrites the upstream's chunks. Each attempt's ``on_close`` runs
    exactly once with its outcome, whether the stream ended, broke or was abandoned.
    """

    def __init__(
        self,
        upstream: UpstreamStream,
        translator: StreamTranslator | None = None,
        tracker: StreamTokens | None = None,
    ) -> None:
        self._current = upstream
        self._translator = translator
        self.tracker = tracker
        #: Set by the proxy for a tracked stream.
        self.resumer: Resumer | None = None
        self._outcome: Outcome = "cancelled"
        self._is_closed = False
        self._is_abandoned = False
        self._closing: asyncio.Future[None] | None = None
        self._relay_iterator = self._relay()
        response = upstream.response
        super().__init__(
            self._relay_iterator,
            status_code=response.status_code,
            headers={**SSE_HEADERS, **returned_headers(response)},
            media_type=response.headers.get("content-type", "text/event-stream"),
        )

    @property
    def upstream(self) -> UpstreamStream:
        """The backend stream being relayed now."""
        return self._current

    async def _relay(self) -> AsyncGenerator[bytes, None]:
        while True:
            try:
                async for out in self._relay_one(self._current):
                    yield out
                if self.tracker is None or not self.tracker.is_resumable:
                    self._outcome = outcome_of_status(self._current.response.status_code)
                    return
                # Our server ended its stream without its last event: it went away.
                cause: ResumeCause = "eof"
                error = APIError(502, "the model server's stream ended early")
                self._outcome = "upstream_broken"
            except httpx.HTTPError as exc:
                is_timeout = isinstance(exc, httpx.TimeoutException)
                cause = "timeout" if is_timeout else "broken"
                self._outcome = "timeout" if is_timeout else "upstream_broken"
                logger.warning("stream from %s broke off: %r", self._current.response.url, exc)
                error = (
                    APIError(504, "the model server stopped sending in time")
                    if is_timeout
                    else APIError(
                        502, f"the model server's stream broke off ({type(exc).__name__})"
                    )
                )
            except _Abandoned:
                cause, self._outcome = "marked_down", "abandoned"
                logger.warning(
                    "stream from %s: its server was marked down", self._current.backend.name
                )
                error = APIError(502, "the model server stopped answering mid-stream")
            following = await self._resume(cause)
            if isinstance(following, UpstreamStream):
                await self._end_attempt(self._current, self._outcome, is_request_over=False)
                self._current, self._outcome = following, "cancelled"
                continue
            if following is not None:  # every choice had finished: end the answer
                self._outcome = "ok"
                yield following
                return
            event = encode_event(error.to_response().model_dump())
            yield self._translator.error_event(event) if self._translator else event
            return

    async def _resume(self, cause: ResumeCause) -> UpstreamStream | bytes | None:
        if self.resumer is None or self.tracker is None or not self.tracker.is_resumable:
            return None
        return await self.resumer.resume(cause, self._current)

    async def _relay_one(self, upstream: UpstreamStream) -> AsyncGenerator[bytes, None]:
        """One attempt's bytes, translated (its first chunk was translated when primed). A
        tracked stream is abandoned when heartbeats mark its server down (see ``_abandon``)."""
        if upstream.first_chunk:
            yield upstream.first_chunk
        waiting = upstream.backend.health.waiting_attempts if self.resumer else None
        if waiting is not None:
            self._is_abandoned = False
            waiting.add(self._abandon)
        try:
            async for chunk in upstream.chunks:
                out = self._translator.feed(chunk) if self._translator else chunk
                if out:
                    if _DONE_EVENT in out:
                        # The answer is complete: a caller that hangs up now (the openai SDK
                        # does as soon as it reads [DONE]) got all of it.
                        self._outcome = outcome_of_status(upstream.response.status_code)
                    yield out
        except (httpx.HTTPError, httpx.StreamError):
            if self._is_abandoned:
                raise _Abandoned from None
            raise
        finally:
            if waiting is not None:
                waiting.discard(self._abandon)
        if self._translator is not None and (tail := self._translator.close()):
            yield tail

    def _abandon(self) -> None:
        """Heartbeats marked the server down: close its response, so that a read waiting on
        a host that sends nothing (black-holed: no reset ever comes) fails now. Closing costs
        nothing per chunk, unlike a cancel scope around every read."""
        self._is_abandoned = True
        self._closing = asyncio.ensure_future(self._current.response.aclose())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()

    async def _end_attempt(
        self, upstream: UpstreamStream, outcome: Outcome, is_request_over: bool
    ) -> None:
        if outcome == "abandoned":
            # Its server was marked down by heartbeats, which keep traffic away until it
            # answers again: no verdict for the circuit breaker too. Each stream of the one
            # outage would count as a failure in a row (the cooldown doubling per stream, up
            # to 300 s of one trial request at a time once the host is back), and the host
            # could then not take the streams of the next server that dies.
            upstream.lease.release()
        upstream.on_close(outcome, is_request_over)
        # Shielded: this also runs when the request task is being cancelled, and an unclosed
        # upstream response would keep the server generating for nobody.
        with anyio.CancelScope(shield=True):
            await upstream.response.aclose()

    async def _close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        with anyio.CancelScope(shield=True):
            await self._relay_iterator.aclose()
        await self._end_attempt(self._current, self._outcome, is_request_over=True)
