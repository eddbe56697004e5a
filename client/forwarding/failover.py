"""Forwarding requests to backends, with failover: JSON answers as is, streams chunk by chunk.

Shared ``httpx.AsyncClient``s carry every upstream call (connection reuse); each attempt on
one backend is run by ``client.forwarding.attempt``, and the tries of one backend after
another by ``client.forwarding.tries`` (which stream resumes use too).

Failover rule: an attempt that fails before any byte reached the caller (refused connection,
server died mid-request, 429/503 overload, 500/502, a jumper key refused or rate-limited) is
retried on another backend, after a jittered exponential backoff, up to ``max_attempts`` local
servers and then up to ``max_attempts`` jumper keys. Streams are primed (the first chunk is
read before the caller gets the status line), so a server that dies before its first chunk
costs nothing. After the first byte was relayed nothing is retried, except that a stream from
one of our servers is resumed on another (``client.forwarding.resume``); otherwise the caller
gets an error event in the stream. A timeout before the first byte is never retried (the same
request would likely time out again, doubling the wait).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import httpx
from starlette.responses import Response

from client.backends.backend import Backend
from client.balancing.router import Router
from client.config.schema import ClientConfig
from client.forwarding.attempt import AttemptRunner
from client.forwarding.resume import StreamResumer
from client.forwarding.stream_relay import StreamRelay
from client.forwarding.tries import try_backends
from client.gateway_request import GatewayRequest
from client.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

#: Caller headers worth passing on (trace correlation; the request id is set by the gateway);
#: credentials are never forwarded.
FORWARDED_REQUEST_HEADERS = ("traceparent", "tracestate")
#: Longest single backoff between two attempts.
MAX_BACKOFF_SECONDS = 1.0


@dataclass
class TriedBackends:
    """The backends a request may no longer use: those it tried, and every backend of a group
    whose attempt budget is spent (``max_attempts`` servers, then ``max_attempts`` fallback
    accounts). A container: routing asks it ``backend in tried``."""

    tried: list[Backend]
    max_attempts: int

    def __contains__(self, backend: object) -> bool:
        if not isinstance(backend, Backend):
            return False
        num_in_group = sum(b.is_fallback == backend.is_fallback for b in self.tried)
        return backend in self.tried or num_in_group >= self.max_attempts

    def __bool__(self) -> bool:
        return bool(self.tried)


class Proxy:
    """Selects backends with the router and forwards the request, failing over when allowed."""

    def __init__(
        self,
        local_client: httpx.AsyncClient,
        upstream_client: httpx.AsyncClient,
        router: Router,
        metrics: GatewayMetrics,
        config: ClientConfig,
        rng: random.Random | None = None,
    ) -> None:
        self.router = router
        self.metrics = metrics
        self.attempts = AttemptRunner(local_client, upstream_client, metrics, config)
        self._config = config
        self._rng = rng or random.Random()

    @property
    def config(self) -> ClientConfig:
        """The running config (attempt budget, backoff, timeouts); read at every request."""
        return self._config

    @config.setter
    def config(self, config: ClientConfig) -> None:
        self._config = config
        self.attempts.config = config

    async def forward(self, request: GatewayRequest) -> Response:
        """The answer for ``request``; raises :class:`APIError` when no backend could be tried."""
        tried: list[Backend] = []
        max_attempts = self.config.max_attempts
        exclude = TriedBackends(tried, max_attempts)
        budget = 2 * max_attempts  # servers' budget + fallback tier's budget
        tries = await try_backends(
            self.router, self.attempts, request, exclude, budget, backoff=self._backoff
        )
        response = tries.response
        if response is not None:
            is_stream = isinstance(response, StreamRelay)
            head = response.upstream.first_chunk if is_stream else response.body
            self.router.response_homes.learn(request, tried[-1].name, bytes(head))
            if isinstance(response, StreamRelay) and response.tracker is not None:
                response.resumer = StreamResumer(
                    self.router, self.attempts, request, tried, response.tracker
                )
            return response
        # After a failure the caller gets what went wrong, not the router's "nothing left".
        if tries.last_failure is None:
            assert tries.refusal is not None
            self.metrics.count_rejected(request.endpoint)
            self.attempts.finish(request, "rejected", None)
            raise tries.refusal
        self.attempts.finish(request, "failed_over", tried[-1])
        return tries.last_failure.response

    def _backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, base * 2**(attempt-1)], capped."""
        ceiling = min(self.config.retry_backoff_seconds * 2 ** (attempt - 1), MAX_BACKOFF_SECONDS)
        return self._rng.uniform(0, ceiling)
