"""Resuming a stream whose server died mid-answer: the rest of the request goes to another
of our servers, from the token ids streamed so far (``protocol.resume``).

The relay (``stream_relay``) calls :meth:`StreamResumer.resume` when a tracked stream breaks
(connection reset, end without its last event, read timeout, server marked down by
heartbeats). The resumer asks the router for another healthy server that can resume (our CB
and SB servers) and was not tried yet, sends it the caller's body with a ``resume`` field
built by the stream's :class:`~client.forwarding.stream_tokens.StreamTokens`, and hands the
relay the new stream, primed. Limits: ``max_stream_resumes`` per stream; only 1 when a server
died within :data:`POISON_SECONDS` of taking the request (the request itself may be what
kills servers: it must not take down a second one, then a third).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from client.backends.backend import Backend
from client.backends.lease import InFlightLease
from client.forwarding.attempt import Retryable
from client.forwarding.stream_relay import StreamRelay, UpstreamStream
from client.forwarding.stream_tokens import StreamTokens, num_choices_of
from client.gateway_request import GatewayRequest
from client.metrics import ResumeCause
from utils.errors import APIError

if TYPE_CHECKING:
    from client.forwarding.failover import Proxy

logger = logging.getLogger(__name__)

#: A server that died this soon after taking a request may have died of it.
POISON_SECONDS = 1.0
_DONE = b"data: [DONE]\n\n"


@dataclasses.dataclass
class ResumeTargets:
    """The backends a continuation may not go to: tried ones, kinds that cannot resume, and
    servers whose context is shorter than the stream already is. A container for routing."""

    tried: list[Backend]
    num_tokens_needed: int

    def __contains__(self, backend: object) -> bool:
        if not isinstance(backend, Backend):
            return False
        max_model_len = backend.health.max_model_len
        is_too_short = max_model_len is not None and max_model_len < self.num_tokens_needed
        return backend in self.tried or not backend.is_resumable or is_too_short


class StreamResumer:
    """Finishes one caller's stream on other servers when the one streaming it dies."""

    def __init__(
        self, proxy: Proxy, request: GatewayRequest, tried: list[Backend], tracker: StreamTokens
    ) -> None:
        self.proxy = proxy
        self.request = request
        self.tried = tried
        self.tracker = tracker
        self.num_resumes = 0
        #: A server died within POISON_SECONDS of taking this request.
        self.is_poison_suspect = False

    def _limit(self) -> int:
        limit = self.proxy.config.max_stream_resumes
        return min(limit, 1) if self.is_poison_suspect else limit

    async def resume(
        self, cause: ResumeCause, broken: UpstreamStream
    ) -> UpstreamStream | bytes | None:
        """The stream that finishes the answer, closing bytes when every choice had finished,
        or None (the caller then gets the error event)."""
        request, tracker = self.request, self.tracker
        if time.monotonic() - broken.lease.taken_at < POISON_SECONDS:
            self.is_poison_suspect = True
        if self.num_resumes >= self._limit():
            logger.warning(
                "request %s: stream from %s broke off (%s); not resumed (%d resumes%s)",
                request.request_id,
                broken.backend.name,
                cause,
                self.num_resumes,
                ", its server died at once" if self.is_poison_suspect else "",
            )
            return None
        num_choices = num_choices_of(request.body)
        choices = tracker.choices
        if all(i in choices and choices[i].is_finished for i in range(num_choices)):
            return _DONE  # only the closing events were lost
        continuation = dataclasses.replace(
            request,
            body=tracker.resume_body(request.body, num_choices),
            plans={},
            resume_tracker=tracker,
        )
        tracker.switch()
        self.num_resumes += 1
        longest = max((len(c.token_ids) for c in choices.values()), default=0)
        targets = ResumeTargets(self.tried, len(tracker.prompt_token_ids) + longest + 1)
        proxy = self.proxy
        for attempt in range(proxy.config.max_attempts):
            try:
                backend = await proxy.router.select(continuation, exclude=targets)
            except APIError as exc:
                logger.warning(
                    "request %s: no server to resume its stream on: %s",
                    request.request_id,
                    exc.message,
                )
                return None
            lease = InFlightLease(backend)
            self.tried.append(backend)
            try:
                response = await proxy.attempts.run(backend, lease, continuation)
            except Retryable as failure:
                proxy.metrics.count_retry(backend, failure.reason)
                continue
            if not isinstance(response, StreamRelay):  # refused (a 4xx): it will not go on
                logger.warning(
                    "request %s: %s refused to resume its stream (HTTP %d)",
                    request.request_id,
                    backend.name,
                    response.status_code,
                )
                return None
            proxy.metrics.count_resumed(broken.backend, cause)
            logger.warning(
                "request %s: stream resumed on %s after %s on %s (%d tokens streamed, "
                "resume %d, attempt %d)",
                request.request_id,
                backend.name,
                cause,
                broken.backend.name,
                tracker.num_tokens,
                self.num_resumes,
                attempt + 1,
            )
            return response.upstream
        return None
