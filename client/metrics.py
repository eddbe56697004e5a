"""Prometheus metrics of the gateway, in a registry of its own per app (no global state)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Literal

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from client.backends.backend import Backend
from client.balancing.registry import BackendRegistry

#: How a request ended, as seen by the gateway.
Outcome = Literal[
    "ok",  # upstream answered 2xx (for streams: the stream ended normally)
    "upstream_client_error",  # upstream answered 4xx (passed back unchanged)
    "upstream_server_error",  # upstream answered 5xx (passed back unchanged)
    "unreachable",  # could not connect to the upstream
    "timeout",  # the upstream went silent for longer than request_timeout_seconds
    "upstream_broken",  # the connection broke mid-answer
    "cancelled",  # the caller went away before the answer ended
    "rejected",  # refused by the gateway itself (bad body, unknown model, no server)
    "failed_over",  # every backend tried failed; the caller got the last failure
    "abandoned",  # the backend was marked down while the attempt waited for its first byte
]

#: Why an attempt was retried on another backend.
RetryReason = Literal[
    "unreachable", "upstream_broken", "overloaded", "server_error", "key_refused", "abandoned"
]
#: Why a stream was resumed: its connection broke, it ended without its last event, it fell
#: silent past the read timeout, or heartbeats marked its server down.
ResumeCause = Literal["broken", "eof", "timeout", "marked_down"]
#: Why a request went to an OpenAI jumper although its route was "auto".
FallbackReason = Literal["no_local_server", "local_failed"]

#: Label value for requests that never reached a backend.
NO_BACKEND = "none"

_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def outcome_of_status(status_code: int) -> Outcome:
    """The outcome of an upstream answer by HTTP status."""
    if status_code < 400:
        return "ok"
    return "upstream_client_error" if status_code < 500 else "upstream_server_error"


#: The per-backend gauges, read from the registry at scrape time: name, help, value.
_BACKEND_GAUGES: tuple[tuple[str, str, Callable[[Backend], float]], ...] = (
    (
        "gateway_backend_healthy",
        "1 when the backend passes its heartbeats",
        lambda backend: 1.0 if backend.health.is_healthy else 0.0,
    ),
    (
        "gateway_backend_circuit_open",
        "1 while the backend's circuit breaker (or a jumper key's rest) keeps traffic away",
        lambda backend: 1.0 if backend.health.breaker.state() == "open" else 0.0,
    ),
    (
        "gateway_backend_in_flight",
        "Requests the gateway has sent to the backend and not finished",
        lambda backend: backend.num_in_flight,
    ),
    (
        "gateway_backend_reported_waiting",
        "Waiting requests at the backend's last health report",
        lambda backend: backend.health.load.num_waiting,
    ),
    (
        "gateway_backend_reported_running",
        "Running requests at the backend's last health report",
        lambda backend: backend.health.load.num_running,
    ),
)


class _BackendCollector(Collector):
    """Reads health, in-flight counts and reported load from the registry at scrape time."""

    def __init__(self, registry: BackendRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for name, documentation, value_of in _BACKEND_GAUGES:
            gauge = GaugeMetricFamily(name, documentation, labels=["backend", "kind"])
            for backend in self._registry.backends:
                gauge.add_metric([backend.name, backend.kind], value_of(backend))
            yield gauge


class GatewayMetrics:
    """Attempts by backend, requests by outcome, retries, fallbacks, plus backend gauges.

    A caller's request may take several attempts (failover): ``gateway_requests_total`` counts
    attempts per backend (``backend="none"`` for requests refused before any attempt),
    ``gateway_request_duration_seconds`` times whole requests as the caller saw them.
    """

    def __init__(self, registry: BackendRegistry) -> None:
        self.collector_registry = CollectorRegistry()
        self._requests = self._counter(
            "gateway_requests",
            "Attempts sent to backends (or refused by the gateway), by endpoint and outcome",
            ["backend", "endpoint", "outcome"],
        )
        self._backend_latency = self._histogram(
            "gateway_backend_latency_seconds",
            "Time from sending a request to a backend to the end of that backend's answer",
            ["backend"],
        )
        self._duration = self._histogram(
            "gateway_request_duration_seconds",
            "Time from receiving a request to the end of its answer (streams included)",
            ["endpoint", "outcome"],
        )
        self._retries = self._counter(
            "gateway_retries",
            "Attempts that failed before any byte reached the caller and were tried elsewhere",
            ["backend", "reason"],
        )
        self._resumed = self._counter(
            "gateway_resumed_streams",
            "Streams that broke off mid-answer and went on from another server, by cause",
            ["backend", "cause"],
        )
        self._fallbacks = self._counter(
            "gateway_fallbacks",
            "Requests sent to an OpenAI jumper because no local server could take them",
            ["reason"],
        )
        self.collector_registry.register(_BackendCollector(registry))

    def _counter(self, name: str, documentation: str, labels: list[str]) -> Counter:
        return Counter(name, documentation, labels, registry=self.collector_registry)

    def _histogram(self, name: str, documentation: str, labels: list[str]) -> Histogram:
        return Histogram(
            name, documentation, labels, buckets=_DURATION_BUCKETS, registry=self.collector_registry
        )

    def observe_attempt(
        self, backend: Backend, endpoint: str, outcome: Outcome, started_at: float
    ) -> None:
        """Count one attempt on ``backend``, timed from ``started_at`` (when the request was
        sent there: after a failover, not when the gateway received it)."""
        self._requests.labels(backend.name, endpoint, outcome).inc()
        self._backend_latency.labels(backend.name).observe(time.monotonic() - started_at)

    def count_rejected(self, endpoint: str) -> None:
        """Count a request the gateway refused before any attempt (``backend="none"``)."""
        self._requests.labels(NO_BACKEND, endpoint, "rejected").inc()

    def observe_request(self, endpoint: str, outcome: Outcome, received_at: float) -> None:
        """Time one caller request from its receipt (``received_at``) to the end of its answer."""
        self._duration.labels(endpoint, outcome).observe(time.monotonic() - received_at)

    def count_retry(self, backend: Backend, reason: RetryReason) -> None:
        """An attempt on ``backend`` failed in a way another backend may not."""
        self._retries.labels(backend.name, reason).inc()

    def count_resumed(self, backend: Backend, cause: ResumeCause) -> None:
        """A stream that broke off on ``backend`` goes on from another server."""
        self._resumed.labels(backend.name, cause).inc()

    def count_fallback(self, reason: FallbackReason) -> None:
        """A request goes to an OpenAI jumper."""
        self._fallbacks.labels(reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.collector_registry), CONTENT_TYPE_LATEST
