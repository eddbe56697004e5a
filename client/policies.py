"""Load-balancing policies: which of the healthy backends serving a model takes a request.

Every policy implements :class:`BalancingPolicy`; the config names one through
:data:`POLICIES`. Policies only choose: the router has already filtered the candidates
(healthy, serving the model, best kind tier) and the proxy counts the request in flight.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from client.backends import Backend


@dataclass(frozen=True)
class RequestInfo:
    """What a policy may know about a request when choosing (more fields come with affinity)."""

    endpoint: str
    model: str | None
    is_stream: bool = False


class BalancingPolicy(abc.ABC):
    """Chooses one backend among candidates; one subclass per policy."""

    #: The name used in ``balancing_policy`` of the config.
    name: ClassVar[str]

    @abc.abstractmethod
    def choose(self, candidates: Sequence[Backend], request_info: RequestInfo) -> Backend:
        """Return one of ``candidates`` (never empty) for the request."""


class LeastOutstandingWork(BalancingPolicy):
    """Send the request where the least work is outstanding.

    Work = the gateway's in-flight count for the backend (exact, up to date) + the waiting and
    running counts the server reported at its last health check (covers work that reached the
    server some other way, e.g. another gateway worker). The in-flight part makes requests that
    arrive between two health checks spread out instead of piling onto one server.

    Ties rotate, so equally loaded servers take turns rather than the first one taking all.
    """

    name: ClassVar[str] = "least_outstanding"

    def __init__(self) -> None:
        self._num_choices = 0

    @staticmethod
    def score(backend: Backend) -> int:
        """Outstanding work of a backend; lower is better."""
        return backend.num_in_flight + backend.num_reported_busy

    def choose(self, candidates: Sequence[Backend], request_info: RequestInfo) -> Backend:
        """The least loaded candidate, rotating among equals."""
        if not candidates:
            raise ValueError("choose() needs at least one candidate")
        scores = [self.score(backend) for backend in candidates]
        best = min(scores)
        tied = [backend for backend, score in zip(candidates, scores, strict=True) if score == best]
        chosen = tied[self._num_choices % len(tied)]
        self._num_choices += 1
        return chosen


#: Policy classes by config name.
POLICIES: dict[str, type[BalancingPolicy]] = {
    LeastOutstandingWork.name: LeastOutstandingWork,
}


def make_policy(name: str) -> BalancingPolicy:
    """A fresh policy instance for the config name ``name``."""
    try:
        policy_class = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown balancing policy {name!r} (known: {known})") from None
    return policy_class()
