"""Each backend's plan for one request, worked out once.

Routing asks every candidate whether it takes the request (``Backend.plan_for``), and a kind
that translates builds its translation to answer; failover asks again after a failure, and the
attempt sends what the chosen backend planned. The forwarding side makes one memo per request
it sends (a resumed stream's continuation gets its own), so all of them share one plan per
backend. Kept apart from the request so that the request knows nothing of backends.
"""

from __future__ import annotations

from client.backends.backend import Backend
from client.backends.plan import Plan
from client.gateway_request import GatewayRequest


class PlanMemo:
    """The plans of the backends asked about :attr:`request` so far."""

    def __init__(self, request: GatewayRequest) -> None:
        self.request = request
        self._plans: dict[Backend, Plan] = {}

    def plan(self, backend: Backend) -> Plan:
        """``backend``'s plan for the request, worked out on first use."""
        plan = self._plans.get(backend)
        if plan is None:
            plan = self._plans[backend] = backend.plan_for(self.request)
        return plan

    def __contains__(self, backend: object) -> bool:
        """True when ``backend`` was asked already."""
        return backend in self._plans
