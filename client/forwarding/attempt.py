"""One attempt of a request on one backend: send it, read or relay the answer, and decide
whether another backend may try (``Retryable``).

The attempt holds an :class:`InFlightLease` on its backend until the answer has been fully
relayed or the caller went away; the lease's verdict feeds the backend's circuit breaker.
Until its first byte, the attempt can be abandoned by its backend (marked down by heartbeats).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import httpx
from starlette.responses import Response

from client.backends.backend import Backend
from client.backends.lease import InFlightLease
from client.backends.plan import Plan
from client.backends.translation import Translation
from client.config.schema import ClientConfig
from client.forwarding.stream_relay import StreamRelay, UpstreamStream, returned_headers
from client.forwarding.stream_tokens import StreamTokens
from client.gateway_request import GatewayRequest
from client.metrics import GatewayMetrics, Outcome, outcome_of_status
from protocol import errors as error_types
from protocol.resume import STREAM_TOKENS_HEADER
from utils.errors import APIError

logger = logging.getLogger(__name__)

#: Upstream statuses that mean "this backend cannot take it now, another may".
OVERLOAD_STATUSES = (429, 503)
#: Upstream statuses that count against the backend's circuit and are retried elsewhere.
FAILURE_STATUSES = (500, 502)


class Retryable(Exception):
    """This attempt failed before any byte reached the caller; another backend may succeed.

    ``response`` is what the caller gets if no other attempt is possible.
    """

    def __init__(self, reason: str, response: Response) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response


@dataclass
class _Attempt:
    """What every step of one attempt needs."""

    backend: Backend
    lease: InFlightLease
    request: GatewayRequest
    translation: Translation | None
    #: The backend's path for a request that goes as sent (None: the caller's endpoint).
    path: str | None = None

    def parts(self) -> tuple[Backend, InFlightLease, GatewayRequest, Translation | None]:
        """The four, for unpacking."""
        return self.backend, self.lease, self.request, self.translation


@dataclass(eq=False)
class AttemptRunner:
    """Runs single attempts with the shared upstream clients."""

    local_client: httpx.AsyncClient
    upstream_client: httpx.AsyncClient
    metrics: GatewayMetrics
    #: Replaced on config reload (timeouts, cooldowns are read at every attempt).
    config: ClientConfig

    async def run(
        self, backend: Backend, lease: InFlightLease, request: GatewayRequest, plan: Plan
    ) -> Response:
        """Send ``request`` to ``backend`` as it planned (``plan``); raises :class:`Retryable`
        if another may try.

        Until its first byte, the attempt runs as a task of its own that the backend can
        abandon when its heartbeats declare it down (a hung server: connections accepted,
        nothing answered); the request is then retried elsewhere.
        """
        task = asyncio.ensure_future(self._attempt_task(backend, lease, request, plan))
        is_abandoned = False

        def abandon() -> None:
            nonlocal is_abandoned
            is_abandoned = lease.is_abandoned = True
            task.cancel()

        backend.health.waiting_attempts.add(abandon)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not is_abandoned or (current is not None and current.cancelling()):
                raise  # the caller went away
            logger.warning(
                "request %s: abandoned on %s (marked down)", request.request_id, backend.name
            )
            error = APIError(
                503, "the model server stopped answering", headers={"Retry-After": "1"}
            )
            raise Retryable("abandoned", error.to_json_response()) from None
        finally:
            backend.health.waiting_attempts.discard(abandon)

    async def _attempt_task(
        self, backend: Backend, lease: InFlightLease, request: GatewayRequest, plan: Plan
    ) -> Response:
        attempt = _Attempt(backend, lease, request, plan.translation, plan.path)
        response: httpx.Response | None = None
        try:
            response = await self._send(attempt)
            if response.status_code >= 400:
                return await self._error_answer(attempt, response)
            if request.is_stream:
                return await self._stream_answer(attempt, response)
            return await self._json_answer(attempt, response)
        except BaseException:
            if not lease.is_released:  # cancelled (or a bug) where no verdict was given
                self._cancelled(backend, lease, request)
            if response is not None:
                # Make sure the connection goes (shielded: this also runs when the caller's
                # task is being cancelled).
                with anyio.CancelScope(shield=True):
                    await response.aclose()
            raise

    async def _send(self, attempt: _Attempt) -> httpx.Response:
        backend, lease, request, translation = attempt.parts()
        headers = {
            "content-type": "application/json",
            **request.headers,
            "x-request-id": request.request_id,
        }
        headers.update(backend.request_headers())
        if _is_tracked(attempt):
            headers[STREAM_TOKENS_HEADER] = "1"
        client = self.upstream_client if backend.uses_proxy else self.local_client
        if translation is not None:
            path, body = translation.request()
        else:
            path, body = attempt.path or request.endpoint, self._body_for(backend, request)
        upstream_request = client.build_request(
            "POST", backend.url_for(path), content=body, headers=headers, timeout=self._timeout()
        )
        try:
            return await client.send(upstream_request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            backend.on_unreachable(
                f"{type(exc).__name__}: {exc}", self.config.jumper_cooldown_seconds
            )
            lease.release(is_failure=True)
            self._observe(lease, request, "unreachable")
            logger.warning("request %s: cannot reach %s: %r", request.request_id, backend.name, exc)
            error = APIError(
                503,
                "the model server chosen for this request is unreachable",
                headers={"Retry-After": "1"},
            )
            raise Retryable("unreachable", error.to_json_response()) from None
        except httpx.HTTPError as exc:
            raise self._transport_failure(attempt, exc) from None

    def _body_for(self, backend: Backend, request: GatewayRequest) -> bytes:
        """The body as sent to ``backend``: unchanged unless the upstream names the model
        differently (``model_map`` of a jumper)."""
        model = request.model
        upstream_model = backend.upstream_model(model)
        if upstream_model == model:
            return request.body
        data = json.loads(request.body)
        data["model"] = upstream_model
        return json.dumps(data).encode()

    def _timeout(self) -> httpx.Timeout:
        config = self.config
        # The read timeout bounds the silence between two chunks, so a long stream that keeps
        # producing is never cut, while a stuck server is.
        return httpx.Timeout(
            connect=config.connect_timeout_seconds,
            read=config.request_timeout_seconds,
            write=config.request_timeout_seconds,
            pool=config.connect_timeout_seconds,
        )

    def _transport_failure(self, attempt: _Attempt, exc: httpx.HTTPError) -> Exception:
        """The exception for a connection that broke or went silent before any byte was relayed
        (the attempt's lease is released as a failure).

        Timeouts end the request (504); a broken connection (the server died) is retryable.
        """
        backend, lease, request, _ = attempt.parts()
        lease.release(is_failure=True)
        logger.warning("request %s: %s failed: %r", request.request_id, backend.name, exc)
        if isinstance(exc, httpx.TimeoutException):
            self._observe(lease, request, "timeout")
            return APIError(504, "the model server did not answer in time")
        self._observe(lease, request, "upstream_broken")
        error = APIError(502, f"the model server's answer broke off ({type(exc).__name__})")
        return Retryable("upstream_broken", error.to_json_response())

    async def _error_answer(self, attempt: _Attempt, response: httpx.Response) -> Response:
        """An upstream 4xx/5xx: passed back, or retried elsewhere when another may succeed."""
        backend, lease, request, translation = attempt.parts()
        status = response.status_code
        try:
            body = await response.aread()
        except httpx.HTTPError:
            body = b""
        finally:
            await response.aclose()
        if translation is not None:
            status, body = translation.error(status, body)
        self._observe(lease, request, outcome_of_status(status))
        body = backend.scrub(body.decode("utf-8", "replace")).encode()
        answer = Response(
            body,
            status_code=status,
            headers=returned_headers(response),
            media_type="application/json",
        )
        if backend.refuses_credentials(status):
            lease.release()
            logger.error(
                "upstream %s refused the gateway's key (HTTP %d); the key rests %.0f s",
                backend.name,
                status,
                backend.health.breaker.seconds_until_retry(),
            )
            # The caller's own credentials are fine: this is the gateway's problem.
            error = APIError(502, f"the upstream refused the gateway's credentials (HTTP {status})")
            raise Retryable("key_refused", error.to_json_response())
        if status in OVERLOAD_STATUSES:
            lease.release()
            backend.on_overloaded(_retry_after(response), self.config.jumper_cooldown_seconds)
            raise Retryable("overloaded", answer)
        if status in FAILURE_STATUSES and not _is_request_failure(body):
            lease.release(is_failure=True)
            raise Retryable("server_error", answer)
        # A 4xx, or a failure the server says was this request's own: the request's fault, not
        # the server's (another server would fail it the same way).
        lease.release(is_failure=False)
        self.finish(request, outcome_of_status(status), backend)
        return answer

    async def _json_answer(self, attempt: _Attempt, response: httpx.Response) -> Response:
        backend, lease, request, translation = attempt.parts()
        try:
            body = await response.aread()
        except httpx.HTTPError as exc:
            raise self._transport_failure(attempt, exc) from None
        finally:
            # Closing before the answer is complete drops the connection: the server aborts.
            await response.aclose()
        lease.release(is_failure=False)
        self._observe(lease, request, "ok")
        self.finish(request, "ok", backend)
        media_type = response.headers.get("content-type", "application/json")
        if translation is not None:
            body, media_type = translation.answer(body), translation.media_type(media_type)
        return Response(
            body,
            status_code=response.status_code,
            headers=returned_headers(response),
            media_type=media_type,
        )

    async def _stream_answer(self, attempt: _Attempt, response: httpx.Response) -> Response:
        """Prime the stream (read its first chunk), then relay the rest as it comes."""
        backend, lease, request, translation = attempt.parts()
        # A resumable stream is tracked: the same tracker goes on across a resume.
        tracker = (request.resume_tracker or StreamTokens()) if _is_tracked(attempt) else None
        translator = backend.stream_filter(translation.stream() if translation else tracker)
        # With nothing to decompress the raw bytes skip httpx's decoder and re-chunker (they
        # are the same bytes); a translator, if any, reads them as they come.
        is_raw = "content-encoding" not in response.headers
        chunks: AsyncIterator[bytes] = response.aiter_raw() if is_raw else response.aiter_bytes()
        try:
            # A translated stream's first upstream chunk may hold no complete event yet: read
            # until there is something to send, so the priming really covers the first byte.
            first_chunk = b""
            async for chunk in chunks:
                first_chunk = translator.feed(chunk) if translator else chunk
                if first_chunk:
                    break
        except httpx.HTTPError as exc:  # cancellation is handled by the caller, _attempt_task
            raise self._transport_failure(attempt, exc) from None

        def on_close(outcome: Outcome, is_request_over: bool) -> None:
            is_failure = None if outcome == "cancelled" else outcome != "ok"
            lease.release(is_failure=is_failure)
            self._observe(lease, request, outcome)
            if is_request_over:
                self.finish(request, outcome, backend)

        upstream = UpstreamStream(backend, lease, response, first_chunk, chunks, on_close)
        return StreamRelay(upstream, translator, tracker)

    def _cancelled(self, backend: Backend, lease: InFlightLease, request: GatewayRequest) -> None:
        """An attempt was cancelled: the caller went away, or the backend was marked down
        while the attempt waited (abandoned: a failure of the backend)."""
        if lease.is_abandoned:
            lease.release(is_failure=True)
            self._observe(lease, request, "abandoned")
        else:
            lease.release()
            self._observe(lease, request, "cancelled")

    def _observe(self, lease: InFlightLease, request: GatewayRequest, outcome: Outcome) -> None:
        backend = lease.backend
        request.attempts.append(f"{backend.name}:{outcome}")
        self.metrics.observe_attempt(backend, request.endpoint, outcome, lease.taken_at)

    def finish(self, request: GatewayRequest, outcome: Outcome, backend: Backend | None) -> None:
        """The request is over (answered, relayed, refused or failed over): time it, and log
        one line that follows it across processes (its id is in the servers' logs too)."""
        self.metrics.observe_request(request.endpoint, outcome, request.received_at)
        logger.info(
            "request %s %s model=%s -> %s: %s after %.3f s (attempts: %s)",
            request.request_id,
            request.endpoint,
            request.model,
            backend.name if backend is not None else "no backend",
            outcome,
            time.monotonic() - request.received_at,
            ", ".join(request.attempts) or "none",
        )


def _is_tracked(attempt: _Attempt) -> bool:
    """True when the attempt's stream is asked for its token ids: a stream from a kind that
    can resume one (our servers), sent as the caller wrote it."""
    return (
        attempt.request.is_stream and attempt.backend.is_resumable and attempt.translation is None
    )


def _is_request_failure(body: bytes) -> bool:
    """True when an error body says the request failed alone (``request_failed_error``)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("type") == error_types.REQUEST_FAILED


def _retry_after(response: httpx.Response) -> float | None:
    """The upstream's Retry-After in seconds, when it gave a number."""
    value = response.headers.get("retry-after", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
