"""One row of the gateway's backend table (``GET /backends`` and ``GET /health``)."""

from __future__ import annotations

import time

from pydantic import BaseModel

from client.backends.backend import Backend, Tier
from client.backends.circuit_breaker import BreakerState
from protocol.health import LoadReport


class BackendStatus(BaseModel):
    """One row of ``GET /backends`` (and of the gateway's ``GET /health``)."""

    name: str
    url: str
    kind: str
    tier: Tier
    is_healthy: bool
    circuit: BreakerState
    seconds_until_retry: float
    reported_status: str | None
    model_ids: list[str]
    max_model_len: int | None
    load: LoadReport
    num_in_flight: int
    num_consecutive_failures: int
    num_requests: int
    num_failures: int
    last_error: str | None
    seconds_since_check: float | None


def status_of(backend: Backend) -> BackendStatus:
    """A JSON-ready snapshot of ``backend``."""
    health = backend.health
    age = None if health.last_checked_at is None else time.monotonic() - health.last_checked_at
    return BackendStatus(
        name=backend.name,
        url=backend.url,
        kind=backend.kind,
        tier=backend.tier,
        is_healthy=health.is_healthy,
        circuit=health.breaker.state(),
        seconds_until_retry=round(health.breaker.seconds_until_retry(), 3),
        reported_status=health.reported_status,
        model_ids=list(health.model_ids),
        max_model_len=health.max_model_len,
        load=health.load,
        num_in_flight=backend.num_in_flight,
        num_consecutive_failures=health.num_consecutive_failures,
        num_requests=health.num_requests,
        num_failures=health.num_failures,
        last_error=health.last_error,
        seconds_since_check=None if age is None else round(age, 3),
    )
