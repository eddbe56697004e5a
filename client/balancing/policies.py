"""Load-balancing policies: which of the healthy backends serving a model takes a request.

Every policy implements :class:`BalancingPolicy`; the config names one through
:data:`POLICIES`. Policies only choose: the router has already filtered the candidates
(healthy, serving the model, best kind tier) and the proxy counts the request in flight.
"""

from __future__ import annotations

import abc
import hashlib
import random
from collections.abc import Sequence
from typing import ClassVar, Literal, Protocol

from client.backends.backend import Backend
from client.gateway_request import GatewayRequest


class BalancingPolicy(abc.ABC):
    """Chooses one backend among candidates; one subclass per policy."""

    #: The name used in ``balancing_policy`` of the config.
    name: ClassVar[str]

    @abc.abstractmethod
    def choose(self, candidates: Sequence[Backend], request: GatewayRequest) -> Backend:
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
        return backend.num_in_flight + backend.health.num_reported_busy

    def choose(self, candidates: Sequence[Backend], request: GatewayRequest) -> Backend:
        """The least loaded candidate, rotating among equals."""
        if not candidates:
            raise ValueError("choose() needs at least one candidate")
        scores = [self.score(backend) for backend in candidates]
        best = min(scores)
        tied = [backend for backend, score in zip(candidates, scores, strict=True) if score == best]
        chosen = tied[self._num_choices % len(tied)]
        self._num_choices += 1
        return chosen


class RoundRobin(BalancingPolicy):
    """Candidates take turns, whatever their load (predictable; good for identical servers)."""

    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._num_choices = 0

    def choose(self, candidates: Sequence[Backend], request: GatewayRequest) -> Backend:
        """The next candidate in turn (the candidate list keeps config order)."""
        if not candidates:
            raise ValueError("choose() needs at least one candidate")
        chosen = candidates[self._num_choices % len(candidates)]
        self._num_choices += 1
        return chosen


class PowerOfTwoChoices(BalancingPolicy):
    """Pick two candidates at random and send the request to the less loaded one.

    Nearly as good as least-outstanding-work when load reports are fresh, and much better
    when they are stale: several gateway workers acting on the same old report do not all
    pile onto the one server that looked idle.
    """

    name: ClassVar[str] = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Backend], request: GatewayRequest) -> Backend:
        """The less loaded of two random candidates (the first of them on a tie)."""
        if not candidates:
            raise ValueError("choose() needs at least one candidate")
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(list(candidates), 2)
        score = LeastOutstandingWork.score
        return second if score(second) < score(first) else first


class SessionAffinity(BalancingPolicy):
    """The same conversation goes to the same server while it is healthy (prefix-cache reuse).

    Rendezvous hashing: each candidate gets a score hash(key, server) and the highest wins, so
    a key keeps its server while the candidate set changes elsewhere, and only the keys of a
    server that leaves move. Bounded load: when the preferred server has more than
    ``max_imbalance`` outstanding requests above the least loaded candidate, the next server in
    the key's ranking takes the request (a hot conversation must not swamp one server).
    Requests without a key are balanced by least outstanding work.
    """

    name: ClassVar[str] = "affinity"

    def __init__(self, max_imbalance: int = 8) -> None:
        self.max_imbalance = max_imbalance
        self._fallback = LeastOutstandingWork()

    @staticmethod
    def rank(key: str, candidates: Sequence[Backend]) -> list[Backend]:
        """Candidates in the key's order of preference."""

        def weight(backend: Backend) -> bytes:
            return hashlib.blake2b(f"{key}\0{backend.name}".encode(), digest_size=8).digest()

        return sorted(candidates, key=weight, reverse=True)

    def choose(self, candidates: Sequence[Backend], request: GatewayRequest) -> Backend:
        """The key's preferred candidate unless it is overloaded compared to the others."""
        if not candidates:
            raise ValueError("choose() needs at least one candidate")
        key = affinity_key_of_request(request)
        if key is None:
            return self._fallback.choose(candidates, request)
        score = LeastOutstandingWork.score
        limit = min(score(backend) for backend in candidates) + self.max_imbalance
        return next(b for b in self.rank(key, candidates) if score(b) <= limit)


class LeastRecentlyUsedKey(BalancingPolicy):
    """For the OpenAI jumper tier: the key used longest ago goes next.

    Spreads traffic over the keys' rate limits evenly, and a key back from a rest (its circuit
    was open) is naturally the first to be tried again.
    """

    name: ClassVar[str] = "least_recently_used_key"

    def choose(self, candidates: Sequence[Backend], request: GatewayRequest) -> Backend:
        """The candidate with the oldest ``last_used_at`` (backends without one count as 0)."""
        if not candidates:
            raise ValueError("choose() needs at least one candidate")
        return min(candidates, key=lambda backend: backend.last_used_at)


#: Characters of a prompt that identify its conversation for affinity: long enough to tell
#: conversations apart, short enough that a growing prompt (the same chat, one more turn)
#: keeps its key.
AFFINITY_PREFIX_CHARS = 256


def affinity_key_of(
    session_header: str | None,
    user: str | None,
    prompt: object | None,
    messages: list[object] | None,
) -> str | None:
    """The conversation key of a request, best evidence first.

    An explicit ``X-Session-ID`` header, then the OpenAI ``user`` field, then the start of the
    conversation: its messages up to the first user message (system prompt and opening
    question stay the same as the chat grows, so every turn lands where the earlier turns left
    their KV cache), or the first characters of a plain prompt.
    """
    if session_header:
        return "session:" + session_header
    if user:
        return "user:" + user
    if messages:
        opening: list[object] = []
        for message in messages:
            opening.append(message.model_dump() if hasattr(message, "model_dump") else message)
            if getattr(message, "role", None) == "user":
                break
        return "chat:" + repr(opening)[: 4 * AFFINITY_PREFIX_CHARS]
    if isinstance(prompt, str) and prompt:
        return "prompt:" + prompt[:AFFINITY_PREFIX_CHARS]
    return None


def affinity_key_of_request(request: GatewayRequest) -> str | None:
    """The conversation key of a gateway request (see :func:`affinity_key_of`)."""
    parsed = request.parsed
    return affinity_key_of(
        request.session_id,
        getattr(parsed, "user", None),
        getattr(parsed, "prompt", None),
        getattr(parsed, "messages", None),
    )


#: Policy classes by config name: the one list of the names ``balancing_policy`` may take.
POLICIES: dict[str, type[BalancingPolicy]] = {
    policy.name: policy
    for policy in (LeastOutstandingWork, RoundRobin, PowerOfTwoChoices, SessionAffinity)
}

#: The names of :data:`POLICIES`, as the config's type (a bad name is refused at validation,
#: the message listing these).
PolicyName = Literal[tuple(POLICIES)]  # type: ignore[valid-type]


class PolicySettings(Protocol):
    """The config keys a policy is made from (the gateway config has them)."""

    balancing_policy: str
    affinity_max_imbalance: int


def make_policy(config: PolicySettings) -> BalancingPolicy:
    """A fresh instance of the policy the config names."""
    name = config.balancing_policy
    if name == SessionAffinity.name:
        return SessionAffinity(config.affinity_max_imbalance)
    try:
        policy_class = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown balancing policy {name!r} (known: {known})") from None
    return policy_class()
