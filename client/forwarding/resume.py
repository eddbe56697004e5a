"""Resuming a stream whose server died mid-answer: the rest of the request goes to another
of our servers, from the token ids streamed so far (``protocol.resume``).

The relay (``stream_relay``) calls :meth:`StreamResumer.resume` when a tracked stream breaks
(connection reset, end without its last event, read timeout, server marked down by
heartbeats). The resumer tries (``client.forwarding.tries``, as failover does) other healthy
servers that can resume (our CB and SB servers) and were not tried yet, with the caller's body
and a ``resume`` field built by the stream's
:class:`~client.forwarding.stream_tokens.StreamTokens`, and hands the relay the new stream,
primed. Limits: ``max_stream_resumes`` per stream, and none after a second server died within
:data:`POISON_SECONDS` of taking the request (the request itself may be what kills servers: it
must not take down a third). One such death alone does not stop the stream: when a server
dies, the streams just moved onto it from an earlier death are young there too, and they are
not what killed it (under load a migration takes seconds, so a second death soon after left
streams with an error that had done nothing wrong).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from client.backends.backend import Backend
from client.balancing.router import Router
from client.forwarding.attempt import AttemptRunner
from client.forwarding.stream_relay import StreamRelay, UpstreamStream
from client.forwarding.stream_tokens import StreamTokens, num_choices_of
from client.forwarding.tries import try_backends
from client.gateway_request import GatewayRequest
from client.metrics import ResumeCause

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


@dataclasses.dataclass(eq=False)
class StreamResumer:
    """Finishes one caller's stream on other servers when the one streaming it dies.

    ``tried`` is the request's list of tried backends (failover's), which resumes go on
    filling; ``runner`` is the proxy's, whose config is the running one (reloads replace it).
    """

    router: Router
    runner: AttemptRunner
    request: GatewayRequest
    tried: list[Backend]
    tracker: StreamTokens
    num_resumes: int = 0
    #: Servers that died within POISON_SECONDS of taking this request.
    num_sudden_deaths: int = 0

    def _limit(self) -> int:
        if self.num_sudden_deaths >= 2:  # a request that kills its servers: no third
            return 0
        return self.runner.config.max_stream_resumes

    async def resume(
        self, cause: ResumeCause, broken: UpstreamStream
    ) -> UpstreamStream | bytes | None:
        """The stream that finishes the answer, closing bytes when every choice had finished,
        or None (the caller then gets the error event)."""
        request, tracker = self.request, self.tracker
        if time.monotonic() - broken.lease.taken_at < POISON_SECONDS:
            self.num_sudden_deaths += 1
        if self.num_resumes >= self._limit():
            logger.warning(
                "request %s: stream from %s broke off (%s); not resumed (%d resumes%s)",
                request.request_id,
                broken.backend.name,
                cause,
                self.num_resumes,
                ", two servers died at once taking it" if self.num_sudden_deaths >= 2 else "",
            )
            return None
        num_choices = num_choices_of(request.body)
        choices = tracker.choices
        if all(i in choices and choices[i].is_finished for i in range(num_choices)):
            return _DONE  # only the closing events were lost
        continuation = dataclasses.replace(
            request,
            body=tracker.resume_body(request.body, num_choices),
            resume_tracker=tracker,
        )
        tracker.switch()
        self.num_resumes += 1
        longest = max((len(c.token_ids) for c in choices.values()), default=0)
        targets = ResumeTargets(self.tried, len(tracker.prompt_token_ids) + longest + 1)
        budget = self.runner.config.max_attempts
        tries = await try_backends(self.router, self.runner, continuation, targets, budget)
        if tries.refusal is not None:
            logger.warning(
                "request %s: no server to resume its stream on: %s",
                request.request_id,
                tries.refusal.message,
            )
            return None
        response, backend = tries.response, tries.backend
        if response is None or backend is None:  # every try failed before its first byte
            return None
        if not isinstance(response, StreamRelay):  # refused (a 4xx): it will not go on
            logger.warning(
                "request %s: %s refused to resume its stream (HTTP %d)",
                request.request_id,
                backend.name,
                response.status_code,
            )
            return None
        self.runner.metrics.count_resumed(broken.backend, cause)
        logger.warning(
            "request %s: stream resumed on %s after %s on %s (%d tokens streamed, "
            "resume %d, attempt %d)",
            request.request_id,
            backend.name,
            cause,
            broken.backend.name,
            tracker.num_tokens,
            self.num_resumes,
            tries.num_tries,
        )
        return response.upstream
