"""The in-flight claim a request holds on the backend it was sent to."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from client.backends.backend import Backend


class InFlightLease:
    """One request counted in ``backend.num_in_flight`` until released.

    Taken right after the balancing decision (with no ``await`` in between, so concurrent
    requests see each other's choices) and released exactly once, however the request ends.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        #: When the request was sent here: the start of this backend's latency.
        self.taken_at = time.monotonic()
        self.is_released = False
        #: Set when the backend was marked down while this request waited there.
        self.is_abandoned = False
        backend.num_in_flight += 1
        backend.health.breaker.on_request_sent()
        backend.on_request_sent()

    def release(self, is_failure: bool | None = None) -> None:
        """Give the claim back, with the verdict for the circuit breaker (None: no verdict).

        Later calls do nothing.
        """
        if self.is_released:
            return
        self.is_released = True
        self.backend.num_in_flight -= 1
        if is_failure is None:
            self.backend.health.breaker.release_trial()
        else:
            self.backend.health.record_result(is_failure)
