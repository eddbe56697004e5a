"""Forwarding requests to the chosen backend: JSON answers as is, streams chunk by chunk.

One shared ``httpx.AsyncClient`` carries every upstream call (connection reuse, one pool).
Each forwarded request holds an :class:`InFlightLease` on its backend from the balancing
decision until the answer has been fully relayed, or the caller went away.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import anyio
import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from client.backends import Backend, InFlightLease
from client.metrics import GatewayMetrics, Outcome, outcome_of_status
from client.policies import RequestInfo
from client.routing import RETRY_AFTER_SECONDS, Router
from utils.errors import APIError, overloaded
from utils.sse import SSE_HEADERS, encode_event

logger = logging.getLogger(__name__)

#: Attempts per request. A connect failure means the request never reached the server, so
#: the failover issue can raise this to retry on another backend (the loop already excludes
#: backends tried before).
MAX_ATTEMPTS = 1

#: Caller headers worth passing on (request correlation); credentials are never forwarded.
FORWARDED_REQUEST_HEADERS = ("x-request-id", "traceparent")
#: Upstream headers passed back to the caller.
RETURNED_RESPONSE_HEADERS = ("retry-after", "x-request-id")


@dataclass
class ForwardRequest:
    """A validated caller request, ready to forward: the original body is sent unchanged."""

    info: RequestInfo
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    received_at: float = field(default_factory=time.monotonic)


class _Unreachable(Exception):
    """The backend could not be connected to: the request never reached it."""

    def __init__(self, api_error: APIError) -> None:
        super().__init__(api_error.message)
        self.api_error = api_error


class Proxy:
    """Selects a backend with the router and forwards the request there."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        router: Router,
        metrics: GatewayMetrics,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> None:
        self.client = client
        self.router = router
        self.metrics = metrics
        self.max_attempts = max_attempts

    async def forward(self, request: ForwardRequest) -> Response:
        """The upstream answer for ``request``; raises :class:`APIError` when there is none."""
        tried: list[Backend] = []
        error: APIError | None = None
        for _ in range(self.max_attempts):
            try:
                backend = await self.router.select(request.info, exclude=tried)
            except APIError as exc:
                error = error or exc  # after a failed attempt, report that failure
                break
            # No await between the choice and the lease: the next request sees this one.
            lease = InFlightLease(backend)
            tried.append(backend)
            try:
                return await self._forward_to(backend, lease, request)
            except _Unreachable as exc:
                error = exc.api_error
        assert error is not None
        if not tried:
            self._observe(None, request, "rejected")
        raise error

    async def _forward_to(
        self, backend: Backend, lease: InFlightLease, request: ForwardRequest
    ) -> Response:
        headers = {"content-type": "application/json", **request.headers}
        headers.update(backend.request_headers())
        upstream_request = self.client.build_request(
            "POST", backend.url_for(request.path), content=request.body, headers=headers
        )
        try:
            response = await self.client.send(upstream_request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            lease.release()
            backend.mark_unreachable(f"{type(exc).__name__}: {exc}")
            self._observe(backend, request, "unreachable")
            logger.warning("cannot reach %s for %s: %r", backend.url, request.path, exc)
            message = "the model server chosen for this request is unreachable"
            raise _Unreachable(overloaded(message, RETRY_AFTER_SECONDS)) from None
        except httpx.HTTPError as exc:
            lease.release()
            raise self._failed(backend, request, exc) from None
        except BaseException:  # cancelled: the caller went away
            lease.release()
            self._observe(backend, request, "cancelled")
            raise
        if request.info.is_stream and response.status_code < 400:
            return _StreamRelay(
                response, on_close=lambda outcome: self._finish(backend, lease, request, outcome)
            )
        try:
            body = await response.aread()
        except httpx.HTTPError as exc:
            raise self._failed(backend, request, exc) from None
        except BaseException:
            self._observe(backend, request, "cancelled")
            raise
        finally:
            # Closing before the answer is complete drops the connection: the server aborts.
            await response.aclose()
            lease.release()
        self._observe(backend, request, outcome_of_status(response.status_code))
        return Response(
            body,
            status_code=response.status_code,
            headers=_returned_headers(response),
            media_type=response.headers.get("content-type", "application/json"),
        )

    def _failed(self, backend: Backend, request: ForwardRequest, exc: httpx.HTTPError) -> APIError:
        """Count a request whose upstream timed out or broke and build the caller's error."""
        logger.warning("request %s to %s failed: %r", request.path, backend.url, exc)
        if isinstance(exc, httpx.TimeoutException):
            self._observe(backend, request, "timeout")
            return APIError(504, "the model server did not answer in time")
        self._observe(backend, request, "upstream_broken")
        return APIError(502, f"the model server's answer broke off ({type(exc).__name__})")

    def _finish(
        self, backend: Backend, lease: InFlightLease, request: ForwardRequest, outcome: Outcome
    ) -> None:
        lease.release()
        self._observe(backend, request, outcome)

    def _observe(self, backend: Backend | None, request: ForwardRequest, outcome: Outcome) -> None:
        duration = time.monotonic() - request.received_at
        self.metrics.observe(backend, request.info.endpoint, outcome, duration)


def _returned_headers(response: httpx.Response) -> dict[str, str]:
    return {
        name: response.headers[name]
        for name in RETURNED_RESPONSE_HEADERS
        if name in response.headers
    }


class _StreamRelay(StreamingResponse):
    """Relays an upstream Server-Sent-Events answer chunk by chunk as the chunks arrive.

    When the caller disconnects, Starlette stops the relay; closing the upstream response
    then drops the upstream connection, which is how the server learns to abort the request.
    Cleanup runs exactly once, whether the stream ended, broke or was abandoned.
    """

    def __init__(self, upstream: httpx.Response, on_close: Callable[[Outcome], None]) -> None:
        self._upstream = upstream
        self._on_close = on_close
        self._outcome: Outcome = "cancelled"
        self._is_closed = False
        self._relay_iterator = self._relay()
        super().__init__(
            self._relay_iterator,
            status_code=upstream.status_code,
            headers={**SSE_HEADERS, **_returned_headers(upstream)},
            media_type=upstream.headers.get("content-type", "text/event-stream"),
        )

    async def _relay(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in self._upstream.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            # The status line is gone already: tell the caller in-band, in the error shape
            # (the openai SDK raises on an event carrying "error").
            is_timeout = isinstance(exc, httpx.TimeoutException)
            self._outcome = "timeout" if is_timeout else "upstream_broken"
            logger.warning("stream from %s broke off: %r", self._upstream.url, exc)
            error = (
                APIError(504, "the model server stopped sending in time")
                if is_timeout
                else APIError(502, f"the model server's stream broke off ({type(exc).__name__})")
            )
            yield encode_event(error.to_response().model_dump())
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
