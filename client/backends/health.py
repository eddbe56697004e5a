"""What heartbeats and requests tell about one backend: up or down, its models and load, and
its circuit breaker (repeated request failures keep traffic away)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from client.backends.circuit_breaker import CircuitBreaker
from protocol.health import LoadReport

logger = logging.getLogger(__name__)

#: Health states in which a server takes requests ("loading" does not).
SERVING_STATES = ("ok", "degraded")


@dataclass
class BackendHealth:
    """The health of one backend, as heartbeats and finished requests report it.

    ``num_consecutive_failures`` counts failed heartbeats; after ``num_failures_to_mark_down``
    of them the server is down (a refused connection on a real request marks it down at once).
    The :class:`CircuitBreaker` counts failed requests.
    """

    #: The backend's label in log lines (its name).
    name: str = ""
    num_failures_to_mark_down: int = 1
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    model_ids: list[str] = field(default_factory=list)
    is_healthy: bool = False
    reported_status: str | None = None
    load: LoadReport = field(default_factory=LoadReport)
    max_model_len: int | None = None
    num_consecutive_failures: int = 0
    last_error: str | None = None
    last_checked_at: float | None = None
    num_requests: int = 0
    num_failures: int = 0
    #: Callbacks that abandon the attempts still waiting for this server's first byte, and
    #: the resumable streams it is sending (they go on from another server).
    waiting_attempts: set[Callable[[], None]] = field(default_factory=set)

    def is_routable(self, now: float | None = None) -> bool:
        """True when new requests may go here: healthy and the circuit lets traffic through."""
        return self.is_healthy and self.breaker.allows_request(now)

    @property
    def num_reported_busy(self) -> int:
        """Requests the server said it was waiting on or running at its last health report."""
        return self.load.num_waiting + self.load.num_running

    def mark_unreachable(self, error: str) -> None:
        """Take the backend out of rotation until a health check finds it up again."""
        self.num_consecutive_failures = max(
            self.num_consecutive_failures + 1, self.num_failures_to_mark_down
        )
        self._set_down(error)

    def record_failed_heartbeat(self, error: str) -> None:
        """A health check failed; the server is down after enough of them in a row.

        Going down this way (the server stopped answering, e.g. hung) also abandons the
        requests waiting there for their first byte, so that they are retried elsewhere
        instead of waiting out the read timeout.
        """
        self.num_consecutive_failures += 1
        if self.num_consecutive_failures >= self.num_failures_to_mark_down:
            was_healthy = self.is_healthy
            self._set_down(error)
            if was_healthy:
                for abandon in list(self.waiting_attempts):
                    abandon()
        else:
            self.last_error = error
            self.last_checked_at = time.monotonic()

    def _set_down(self, error: str) -> None:
        if self.is_healthy:
            logger.warning("backend %s is now unhealthy: %s", self.name, error)
        self.is_healthy = False
        self.last_error = error
        self.last_checked_at = time.monotonic()

    def record_health(
        self, status: str, model_ids: list[str], max_model_len: int | None, load: LoadReport
    ) -> None:
        """Record a health check that got an answer: the status, models and load it reported."""
        is_serving = status in SERVING_STATES
        if is_serving and not self.is_healthy:
            logger.info("backend %s is healthy, serving %s", self.name, model_ids)
            # Back from down (typically restarted): its past request failures say little about
            # the new process, so one trial request may go at once instead of after the rest
            # of the cooldown.
            self.breaker.end_cooldown()
        elif not is_serving and self.is_healthy:
            logger.warning("backend %s is no longer serving (status %s)", self.name, status)
        self.is_healthy = is_serving
        self.reported_status = status
        # Keep what was learned before if a report names no model, so that requests for a model
        # whose only server is briefly down get 503 ("try later") rather than 404 ("no such").
        self.model_ids = model_ids or self.model_ids
        self.max_model_len = max_model_len
        self.load = load
        self.num_consecutive_failures = 0
        self.last_error = None if is_serving else f"server status is {status!r}"
        self.last_checked_at = time.monotonic()

    def record_result(self, is_failure: bool) -> None:
        """Feed one finished request into the circuit breaker."""
        self.num_requests += 1
        if not is_failure:
            self.breaker.record_success()
            return
        self.num_failures += 1
        if self.breaker.record_failure():
            logger.warning(
                "backend %s: circuit opened after %d failed requests in a row; no traffic for "
                "%.1f s",
                self.name,
                self.breaker.num_consecutive_failures,
                self.breaker.seconds_until_retry(),
            )
