"""Routing: from a request's model to one backend, or to the error that explains why none."""

from __future__ import annotations

from collections.abc import Container

from client.backends.backend import Backend
from client.backends.plan_memo import PlanMemo
from client.balancing.policies import BalancingPolicy, LeastRecentlyUsedKey
from client.balancing.registry import BackendRegistry
from client.balancing.response_homes import ResponseHomes
from client.gateway_request import GatewayRequest, route_allows
from utils.errors import APIError, overloaded

#: Retry-After of "no server can take this now": the next request triggers a health refresh
#: of its own, so a quick retry is cheap and finds a server as soon as one is back.
RETRY_AFTER_SECONDS = 1


class Router:
    """Chooses the backend for a request with the configured balancing policy.

    A request without a model (or with ``""``) may go to any healthy backend. When nothing
    fits, the registry is refreshed once (so a server started after the gateway is found)
    before answering 404 (no server has ever served the model) or 503 (servers that serve it,
    or all servers, are down right now).
    """

    def __init__(self, registry: BackendRegistry, policy: BalancingPolicy) -> None:
        self.registry = registry
        self.policy = policy
        #: The jumper tier spreads over API keys, not over servers' load.
        self.key_policy = LeastRecentlyUsedKey()
        #: Where each relayed Responses API answer is stored (``previous_response_id``).
        self.response_homes = ResponseHomes()

    async def select(
        self,
        request: GatewayRequest,
        exclude: Container[Backend] = (),
        plans: PlanMemo | None = None,
    ) -> Backend:
        """The backend for ``request``; raises :class:`APIError` (404/503) when there is none.

        ``exclude`` lists backends already tried for this request (failover); ``plans`` keeps
        the backends' plans for it (the attempt sends the chosen one's).
        """
        plans = PlanMemo(request) if plans is None else plans
        candidates = self.registry.candidates(request, exclude, plans)
        if not candidates or (candidates[0].is_fallback and request.route == "auto"):
            # Before falling back upstream (or giving up), make sure no server came back.
            await self.registry.refresh_if_stale()
            candidates = self.registry.candidates(request, exclude, plans)
        if not candidates:
            raise self._no_candidate_error(plans, exclude)
        home = self.response_homes.home_of(request)
        pinned = [backend for backend in candidates if backend.name == home]
        if pinned:  # the conversation is stored there (elsewhere it would be a 404)
            return pinned[0]
        policy = self.key_policy if candidates[0].is_fallback else self.policy
        return policy.choose(candidates, request)

    def _no_candidate_error(self, plans: PlanMemo, exclude: Container[Backend]) -> APIError:
        request = plans.request
        registry, model, route = self.registry, request.model, request.route
        backends = [
            backend for backend in registry.backends if route_allows(route, backend.is_fallback)
        ]
        num_configured = len(backends)
        where = {"auto": "model server", "local": "local model server", "openai": "OpenAI jumper"}
        if num_configured == 0:
            return overloaded(
                f"no {where[route]} is configured on this gateway", RETRY_AFTER_SECONDS
            )
        healthy = [b for b in registry.healthy() if b not in exclude and b in backends]
        if not healthy:
            return overloaded(
                f"no {where[route]} can take the request right now "
                f"({num_configured} configured, none available)",
                RETRY_AFTER_SECONDS,
            )
        serving = [b for b in healthy if model is None or b.serves(model)]
        serving_plans = [plans.plan(b) for b in serving]
        errors = [plan.error for plan in serving_plans]
        if serving and all(errors):  # invalid in the meaning every backend that can serve needs
            assert errors[0] is not None
            return errors[0]
        refusals = [plan.refusal for plan in serving_plans]
        if serving and all(refusals):
            reasons = "; ".join(sorted({reason for reason in refusals if reason}))
            return overloaded(
                f"no server that can take this request is available right now: {reasons}",
                RETRY_AFTER_SECONDS,
            )
        if model is None or bool(exclude) or model in registry.model_ids(is_healthy_only=False):
            return overloaded(
                f"no healthy server serves model {model!r} right now", RETRY_AFTER_SECONDS
            )
        available = registry.model_ids()
        listed = ", ".join(repr(m) for m in available) if available else "none"
        return APIError(
            404,
            f"model {model!r} is not served by this gateway; available models: {listed}",
            param="model",
        )
