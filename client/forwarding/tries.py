"""Trying backends one after another for one request: the loop that failover
(``client.forwarding.failover``) and stream resumes (``client.forwarding.resume``) share.

Each try asks the router for a backend the request may still use (``exclude``), leases it (no
await between the choice and the lease: the next request sees this choice) and runs one
attempt. An attempt that fails before any byte reached the caller (``Retryable``) is counted,
and the next try goes on until ``budget`` tries are spent; the first answer that is not
retryable ends the tries, and so does the router when no backend is left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from starlette.responses import Response

from client.backends.backend import Backend
from client.backends.lease import InFlightLease
from client.backends.plan_memo import PlanMemo
from client.balancing.router import Router
from client.forwarding.attempt import AttemptRunner, Retryable
from client.gateway_request import GatewayRequest
from utils.errors import APIError


class Exclusion(Protocol):
    """The backends a request may no longer use, for routing (``backend in exclude``), and
    the list of those it tried, which each try appends its backend to."""

    tried: list[Backend]

    def __contains__(self, backend: object) -> bool: ...


@dataclass
class Tries:
    """How the tries of one request ended.

    ``response`` is the first answer that was not retryable (from ``backend``), or None: then
    ``refusal`` is the router's error when it found no backend to try, and ``last_failure``
    the last retryable failure (None when nothing was tried).
    """

    response: Response | None = None
    backend: Backend | None = None
    #: Tries made, the one that answered included.
    num_tries: int = 0
    last_failure: Retryable | None = None
    refusal: APIError | None = None


async def try_backends(
    router: Router,
    runner: AttemptRunner,
    request: GatewayRequest,
    exclude: Exclusion,
    budget: int,
    backoff: Callable[[int], float] | None = None,
) -> Tries:
    """Try backends for ``request`` until one answers, at most ``budget`` times.

    ``backoff(n)`` is the pause before the ``n``-th retry (none when not given); it comes
    before the choice, so the choice sees the state after the pause.
    """
    plans = PlanMemo(request)  # routing, later tries and the attempt share each plan
    tries = Tries()
    for attempt in range(budget):
        if attempt > 0 and backoff is not None:
            await asyncio.sleep(backoff(attempt))
        try:
            backend = await router.select(request, exclude=exclude, plans=plans)
        except APIError as exc:
            tries.refusal = exc
            return tries
        if backend.is_fallback and request.route == "auto":
            reason = "local_failed" if exclude.tried else "no_local_server"
            runner.metrics.count_fallback(reason)
        lease = InFlightLease(backend)
        exclude.tried.append(backend)
        tries.num_tries = attempt + 1
        try:
            tries.response = await runner.run(backend, lease, request, plans.plan(backend))
        except Retryable as failure:
            runner.metrics.count_retry(backend, failure.reason)
            tries.last_failure = failure
            continue
        tries.backend = backend
        return tries
    return tries
