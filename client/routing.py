"""Routing: from a request's model to one backend, or to the error that explains why none."""

from __future__ import annotations

from collections.abc import Collection

from client.backends import Backend
from client.policies import BalancingPolicy, RequestInfo
from client.registry import BackendRegistry
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

    async def select(self, info: RequestInfo, exclude: Collection[Backend] = ()) -> Backend:
        """The backend for ``info``; raises :class:`APIError` (404/503) when there is none.

        ``exclude`` lists backends already tried for this request (failover).
        """
        model = info.model or None
        candidates = self.registry.candidates(model, exclude)
        if not candidates:
            await self.registry.refresh_if_stale()
            candidates = self.registry.candidates(model, exclude)
        if not candidates:
            raise self._no_candidate_error(model, exclude)
        return self.policy.choose(candidates, info)

    def _no_candidate_error(self, model: str | None, exclude: Collection[Backend]) -> APIError:
        registry = self.registry
        num_configured = len(registry.backends)
        if num_configured == 0:
            return overloaded("no model server is configured on this gateway", RETRY_AFTER_SECONDS)
        healthy = [backend for backend in registry.healthy() if backend not in exclude]
        if not healthy:
            return overloaded(
                f"no model server can take the request right now "
                f"({num_configured} configured, none healthy)",
                RETRY_AFTER_SECONDS,
            )
        if model is None or exclude or model in registry.model_ids(is_healthy_only=False):
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
