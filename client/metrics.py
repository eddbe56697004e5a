"""Prometheus metrics of the gateway, in a registry of its own per app (no global state)."""

from __future__ import annotations

from collections.abc import Iterator
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

from client.backends import Backend
from client.registry import BackendRegistry

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
]

#: Label value for requests that never reached a backend.
NO_BACKEND = "none"

_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def outcome_of_status(status_code: int) -> Outcome:
    """The outcome of an upstream answer by HTTP status."""
    if status_code < 400:
        return "ok"
    return "upstream_client_error" if status_code < 500 else "upstream_server_error"


class _BackendCollector(Collector):
    """Reads health, in-flight counts and reported load from the registry at scrape time."""

    def __init__(self, registry: BackendRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        labels = ["backend", "kind"]
        healthy = GaugeMetricFamily(
            "gateway_backend_healthy", "1 when the backend takes requests", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "gateway_backend_in_flight",
            "Requests the gateway has sent to the backend and not finished",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "gateway_backend_reported_waiting",
            "Waiting requests at the backend's last health report",
            labels=labels,
        )
        running = GaugeMetricFamily(
            "gateway_backend_reported_running",
            "Running requests at the backend's last health report",
            labels=labels,
        )
        for backend in self._registry.backends:
            values = [backend.url, backend.kind]
            healthy.add_metric(values, 1.0 if backend.is_healthy else 0.0)
            in_flight.add_metric(values, backend.num_in_flight)
            waiting.add_metric(values, backend.load.num_waiting)
            running.add_metric(values, backend.load.num_running)
        yield from (healthy, in_flight, waiting, running)


class GatewayMetrics:
    """Request counts and durations by backend, endpoint and outcome, plus backend gauges."""

    def __init__(self, registry: BackendRegistry) -> None:
        self.collector_registry = CollectorRegistry()
        self._requests = Counter(
            "gateway_requests",
            "Requests handled by the gateway, by backend, endpoint and outcome",
            ["backend", "endpoint", "outcome"],
            registry=self.collector_registry,
        )
        self._duration = Histogram(
            "gateway_request_duration_seconds",
            "Time from receiving a request to the end of its answer (streams included)",
            ["endpoint", "outcome"],
            buckets=_DURATION_BUCKETS,
            registry=self.collector_registry,
        )
        self.collector_registry.register(_BackendCollector(registry))

    def observe(
        self,
        backend: Backend | None,
        endpoint: str,
        outcome: Outcome,
        duration_seconds: float,
    ) -> None:
        """Count one finished request."""
        backend_label = backend.url if backend is not None else NO_BACKEND
        self._requests.labels(backend_label, endpoint, outcome).inc()
        self._duration.labels(endpoint, outcome).observe(duration_seconds)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.collector_registry), CONTENT_TYPE_LATEST
