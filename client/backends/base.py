"""One upstream server as the gateway sees it: address, kind, served models, health and load."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import httpx
from pydantic import BaseModel, ValidationError

from client.backends.circuit_breaker import BreakerState, CircuitBreaker
from client.backends.translation import StreamTranslator, Translation
from client.gateway_request import GatewayRequest
from protocol.health import HealthResponse, LoadReport
from protocol.openai_api import ModelList

logger = logging.getLogger(__name__)

BackendKind = Literal[
    "continuous_batching", "static_batching", "triton", "openai_compatible", "embedding", "openai"
]

#: Lower is preferred: a request goes to an SB server only when no CB server serving its model
#: can take it, and to an OpenAI jumper only when no local server can.
KIND_PRIORITY: dict[BackendKind, int] = {
    "continuous_batching": 0,
    "triton": 0,  # Triton + TensorRT-LLM batches continuously too: it shares the first tier
    "openai_compatible": 0,  # vLLM, llama.cpp, SGLang, TGI: servers like ours, not a fallback
    "embedding": 0,  # the only kind of ours that embeds: no tier competes with it
    "static_batching": 1,
    "openai": 2,
}

#: Health states in which a server takes requests ("loading" does not).
_SERVING_STATES = ("ok", "degraded")


@dataclass(frozen=True)
class Plan:
    """How a backend would take a request: refused (``refusal`` says why), or in which form
    (``translation``; None: the caller's body goes unchanged)."""

    refusal: str | None = None
    translation: Translation | None = None

    @property
    def is_accepted(self) -> bool:
        """True when the backend can take the request."""
        return self.refusal is None


#: Our own servers take every request as the caller sent it.
AS_SENT = Plan()
#: The embeddings endpoint, which our generation servers do not answer.
EMBEDDINGS_PATH = "/v1/embeddings"


class BackendStatus(BaseModel):
    """One row of ``GET /backends`` (and of the gateway's ``GET /health``)."""

    name: str
    url: str
    kind: BackendKind
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


@dataclass(eq=False)  # identity semantics: backends go in sets (e.g. "already tried")
class Backend:
    """A model server behind the gateway.

    Health, served models and load come from the server's ``GET /health`` (and ``/v1/models``);
    ``num_in_flight`` is the gateway's own count of requests it has sent there and not finished.
    ``num_consecutive_failures`` counts failed heartbeats; after ``num_failures_to_mark_down``
    of them the server is down (a refused connection on a real request marks it down at once).
    The :class:`CircuitBreaker` counts failed requests.
    """

    url: str
    kind: BackendKind
    num_failures_to_mark_down: int = 1
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    model_ids: list[str] = field(default_factory=list)
    is_healthy: bool = False
    reported_status: str | None = None
    load: LoadReport = field(default_factory=LoadReport)
    max_model_len: int | None = None
    num_in_flight: int = 0
    num_consecutive_failures: int = 0
    last_error: str | None = None
    last_checked_at: float | None = None
    num_requests: int = 0
    num_failures: int = 0
    #: Callbacks that abandon the attempts still waiting for this server's first byte.
    waiting_attempts: set[Callable[[], None]] = field(default_factory=set)

    @property
    def name(self) -> str:
        """The label of this backend in logs, metrics and the status table."""
        return self.url

    @property
    def identity(self) -> tuple[object, ...]:
        """What makes a configured backend the same one across config reloads."""
        return (self.kind, self.url)

    def adopt_settings(self, fresh: Backend) -> None:
        """Take the settings of ``fresh`` (the same backend, built from a reloaded config),
        keeping this one's state: health, load, circuit (kinds with settings override this)."""

    @property
    def is_local(self) -> bool:
        """True for our own model servers (False for OpenAI-compatible upstreams)."""
        return self.kind != "openai"

    def is_routable(self, now: float | None = None) -> bool:
        """True when new requests may go here: healthy and the circuit lets traffic through."""
        return self.is_healthy and self.breaker.allows_request(now)

    def plan(self, request: GatewayRequest) -> Plan:
        """Whether this backend can take ``request``, and in which form (backend kinds that
        speak another API override this; our generation servers take everything as sent but
        embeddings)."""
        if request.endpoint == EMBEDDINGS_PATH:
            return Plan(refusal=f"{self.kind.replace('_', '-')} servers do not embed")
        return AS_SENT

    def plan_for(self, request: GatewayRequest) -> Plan:
        """:meth:`plan`, worked out once per request and backend (kept on the request, so
        routing, failover and the attempt share the translation it built)."""
        plan = request.plans.get(self)
        if not isinstance(plan, Plan):
            plan = request.plans[self] = self.plan(request)
        return plan

    def upstream_model(self, model: str | None) -> str | None:
        """The model id to send upstream for the gateway's ``model`` (same id here)."""
        return model

    @property
    def priority(self) -> int:
        """Routing tier of this backend's kind (lower is preferred)."""
        return KIND_PRIORITY[self.kind]

    @property
    def num_reported_busy(self) -> int:
        """Requests the server said it was waiting on or running at its last health report."""
        return self.load.num_waiting + self.load.num_running

    def serves(self, model: str) -> bool:
        """True when this backend announced ``model`` among its model ids."""
        return model in self.model_ids

    def url_for(self, path: str) -> str:
        """The upstream address of an API path such as ``/v1/chat/completions``."""
        return self.url + path

    def request_headers(self) -> dict[str, str]:
        """Headers added to every forwarded request (jumpers add their API key here)."""
        return {}

    def on_request_sent(self) -> None:
        """Hook for subclasses: a request was just sent here (jumpers note the time)."""

    def on_unreachable(self, error: str, cooldown_seconds: float) -> None:
        """A request could not connect: out of rotation until a heartbeat finds it up again
        (kinds without heartbeats rest for ``cooldown_seconds`` instead)."""
        self.mark_unreachable(error)

    def on_overloaded(self, retry_after_seconds: float | None, cooldown_seconds: float) -> None:
        """The backend answered 429/503; our servers report their queue in heartbeats, so
        nothing more to do here (upstream keys rest)."""

    def refuses_credentials(self, status: int) -> bool:
        """True when ``status`` means the gateway's own credentials were refused (then the
        backend rests itself); our servers take no credentials."""
        return False

    def scrub(self, text: str) -> str:
        """``text`` (an upstream error) without secrets of this backend (ours have none)."""
        return text

    def stream_filter(self, translator: StreamTranslator | None) -> StreamTranslator | None:
        """What every streamed byte from this backend goes through (``translator``, if any;
        kinds holding secrets add a scrubber, since an error event may quote them)."""
        return translator

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

    def apply_health(self, health: HealthResponse, listed_model_ids: list[str]) -> None:
        """Record a successful health report (and the ids the server lists on /v1/models)."""
        if health.kind != self.kind and health.kind != "gateway":
            logger.warning(
                "backend %s is configured as %s but reports kind %s; routing uses the config",
                self.url,
                self.kind,
                health.kind,
            )
        model_ids = [health.model] if health.model else []
        model_ids += [m for m in listed_model_ids if m not in model_ids]
        self.record_health(health.status, model_ids, health.max_model_len, health.load)

    def record_health(
        self, status: str, model_ids: list[str], max_model_len: int | None, load: LoadReport
    ) -> None:
        """Record a health check that got an answer: the status, models and load it reported."""
        is_serving = status in _SERVING_STATES
        if is_serving and not self.is_healthy:
            logger.info("backend %s is healthy, serving %s", self.url, model_ids)
            # Back from down (typically restarted): its past request failures say little about
            # the new process, so one trial request may go at once instead of after the rest
            # of the cooldown.
            self.breaker.end_cooldown()
        elif not is_serving and self.is_healthy:
            logger.warning("backend %s is no longer serving (status %s)", self.url, status)
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

    async def probe(self, client: httpx.AsyncClient, timeout_seconds: float) -> None:
        """Ask the server for ``/health`` and ``/v1/models`` and record the answer.

        Never raises for network or protocol problems: they mark the backend unhealthy.
        """
        # Both calls are bounded by the timeout, so waiting for the pair costs no extra time.
        health, listed_model_ids = await asyncio.gather(
            self._get_health(client, timeout_seconds),
            self._get_model_ids(client, timeout_seconds),
            return_exceptions=True,
        )
        if isinstance(health, BaseException):
            if not isinstance(health, _ProbeError):
                raise health
            self.record_failed_heartbeat(str(health))
            return
        if isinstance(listed_model_ids, BaseException):
            raise listed_model_ids
        self.apply_health(health, listed_model_ids)

    async def _get_health(
        self, client: httpx.AsyncClient, timeout_seconds: float
    ) -> HealthResponse:
        try:
            response = await client.get(self.url_for("/health"), timeout=timeout_seconds)
        except httpx.HTTPError as exc:
            raise _ProbeError(f"GET /health failed: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise _ProbeError(f"GET /health answered HTTP {response.status_code}")
        try:
            return HealthResponse.model_validate_json(response.content)
        except ValidationError as exc:
            raise _ProbeError(f"GET /health answered an invalid report: {exc}") from None

    async def _get_model_ids(self, client: httpx.AsyncClient, timeout_seconds: float) -> list[str]:
        """The ids on ``/v1/models``; optional (the health report's model is enough)."""
        try:
            response = await client.get(self.url_for("/v1/models"), timeout=timeout_seconds)
            response.raise_for_status()
            return [card.id for card in ModelList.model_validate_json(response.content).data]
        except (httpx.HTTPError, ValidationError) as exc:
            logger.debug("backend %s: GET /v1/models failed: %s", self.url, exc)
            return []

    def status(self) -> BackendStatus:
        """A JSON-ready snapshot of this backend."""
        age = None if self.last_checked_at is None else time.monotonic() - self.last_checked_at
        return BackendStatus(
            name=self.name,
            url=self.url,
            kind=self.kind,
            is_healthy=self.is_healthy,
            circuit=self.breaker.state(),
            seconds_until_retry=round(self.breaker.seconds_until_retry(), 3),
            reported_status=self.reported_status,
            model_ids=list(self.model_ids),
            max_model_len=self.max_model_len,
            load=self.load,
            num_in_flight=self.num_in_flight,
            num_consecutive_failures=self.num_consecutive_failures,
            num_requests=self.num_requests,
            num_failures=self.num_failures,
            last_error=self.last_error,
            seconds_since_check=None if age is None else round(age, 3),
        )


class _ProbeError(Exception):
    """A health check that found the server unreachable or answering nonsense."""


class InFlightLease:
    """One request's claim on a backend, counted in ``num_in_flight`` until released.

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
        backend.breaker.on_request_sent()
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
            self.backend.breaker.release_trial()
        else:
            self.backend.record_result(is_failure)
