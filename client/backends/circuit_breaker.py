"""A per-backend circuit breaker: repeated request failures keep traffic away for a while.

Heartbeats tell whether a server answers ``/health``; the breaker tells whether real requests
succeed there. A server that accepts connections but fails requests (crashing worker, broken
model, upstream key rate-limited) would otherwise keep receiving and failing traffic between
two heartbeats.

States: *closed* (traffic flows), *open* (no traffic until the cooldown ends), *half-open*
(cooldown over: one trial request may go; its success closes the circuit, its failure opens it
again for twice as long, up to a cap).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]

#: Longest cooldown after repeated trips (the cooldown doubles on each failed trial).
MAX_COOLDOWN_SECONDS = 300.0


@dataclass
class CircuitBreaker:
    """Counts consecutive request failures of one backend and opens after ``failure_threshold``."""

    failure_threshold: int = 3
    cooldown_seconds: float = 15.0
    num_consecutive_failures: int = 0
    #: Consecutive openings without a success in between (grows the cooldown).
    num_trips: int = 0
    opened_until: float | None = None
    is_trial_in_flight: bool = False
    #: Told the seconds of each opening, and each closing (gateway replicas share them).
    on_open: Callable[[float], None] | None = field(default=None, repr=False, compare=False)
    on_close: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def state(self, now: float | None = None) -> BreakerState:
        """The state at ``now`` (monotonic seconds; default: the current time)."""
        if self.opened_until is None:
            return "closed"
        now = time.monotonic() if now is None else now
        return "open" if now < self.opened_until else "half_open"

    def allows_request(self, now: float | None = None) -> bool:
        """True when a new request may go to the backend now."""
        state = self.state(now)
        return state == "closed" or (state == "half_open" and not self.is_trial_in_flight)

    def seconds_until_retry(self, now: float | None = None) -> float:
        """How long until the backend may take traffic again (0 when it may now)."""
        if self.opened_until is None:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, self.opened_until - now)

    def on_request_sent(self, now: float | None = None) -> None:
        """Note that a request was sent; in half-open state it is the one trial."""
        if self.state(now) == "half_open":
            self.is_trial_in_flight = True

    def record_success(self) -> None:
        """A request succeeded: close the circuit and forget past failures."""
        if self.opened_until is not None and self.on_close is not None:
            self.on_close()
        self.num_consecutive_failures = 0
        self.num_trips = 0
        self.opened_until = None
        self.is_trial_in_flight = False

    def record_failure(self, now: float | None = None) -> bool:
        """A request failed; returns True when this failure opened the circuit."""
        now = time.monotonic() if now is None else now
        self.num_consecutive_failures += 1
        if self.state(now) == "open":
            # A request sent before the circuit opened (a server that died with many in
            # flight): the opening already counts it; only a failed trial doubles the cooldown.
            return False
        was_trial = self.is_trial_in_flight or self.state(now) == "half_open"
        if was_trial or self.num_consecutive_failures >= self.failure_threshold:
            cooldown = min(self.cooldown_seconds * 2**self.num_trips, MAX_COOLDOWN_SECONDS)
            self.open_for(cooldown, now)
            return True
        return False

    def open_for(self, seconds: float, now: float | None = None) -> None:
        """Keep traffic away for ``seconds`` (e.g. an upstream's Retry-After)."""
        now = time.monotonic() if now is None else now
        until = now + seconds
        self.opened_until = until if self.opened_until is None else max(self.opened_until, until)
        self.num_trips += 1
        self.is_trial_in_flight = False
        if self.on_open is not None:
            self.on_open(self.opened_until - now)

    def adopt_opening(self, seconds: float, now: float | None = None) -> None:
        """Stay open at least ``seconds`` because another gateway replica opened this circuit.

        Unlike :meth:`open_for` this neither counts a trip nor reports the opening again.
        """
        now = time.monotonic() if now is None else now
        until = now + seconds
        if seconds > 0 and (self.opened_until is None or until > self.opened_until):
            self.opened_until = until
            self.is_trial_in_flight = False

    def end_cooldown(self, now: float | None = None) -> None:
        """Move an open circuit to half-open now (e.g. the server restarted): one trial goes."""
        now = time.monotonic() if now is None else now
        if self.opened_until is not None and self.opened_until > now:
            self.opened_until = now
            self.is_trial_in_flight = False
            if self.on_close is not None:
                self.on_close()

    def release_trial(self) -> None:
        """A trial request ended without a verdict (e.g. the caller left): allow another."""
        self.is_trial_in_flight = False
