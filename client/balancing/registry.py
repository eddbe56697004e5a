"""All backends of the gateway, their periodic health refresh, and candidate lookup by model."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container

import httpx

from client.backends.backend import Backend
from client.backends.plan_memo import PlanMemo
from client.balancing.discovery import DNSDiscovery
from client.balancing.shared_state import SharedBreakerState
from client.config.kinds import backends_from_config
from client.config.schema import ClientConfig
from client.gateway_request import GatewayRequest, route_allows
from utils.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


#: A request that finds no candidate triggers a refresh, but at most this often: a burst of
#: requests for a dead server then costs one round of health checks, not one per request.
LAZY_REFRESH_MIN_INTERVAL_SECONDS = 0.25


class BackendRegistry:
    """Holds every configured backend and keeps their health and load up to date.

    Life cycle: :meth:`start` (first refresh, then a background refresh every heartbeat
    interval) and :meth:`stop`. A server that is down at start-up does not stop the gateway:
    it is marked unhealthy and found by a later refresh.

    Servers named by DNS (see :mod:`client.balancing.discovery`) are resolved again before
    every heartbeat's health checks, and the result is applied like a config reload.
    """

    def __init__(
        self,
        backends: list[Backend],
        *,
        health_timeout_seconds: float = 3.0,
        heartbeat_interval_seconds: float = 10.0,
        lazy_refresh_min_interval_seconds: float = LAZY_REFRESH_MIN_INTERVAL_SECONDS,
        discovery: DNSDiscovery | None = None,
    ) -> None:
        self.backends = backends
        self.discovery = discovery or DNSDiscovery()
        #: The config as the file says (without discovered servers); None when built by hand.
        self.config: ClientConfig | None = None
        #: Circuit openings shared with other gateway replicas (``shared_state_url``).
        self.shared_state: SharedBreakerState | None = None
        self.health_timeout_seconds = health_timeout_seconds
        self.heartbeat_interval_seconds = heartbeat_interval_seconds
        self.lazy_refresh_min_interval_seconds = lazy_refresh_min_interval_seconds
        self._client: httpx.AsyncClient | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._refresh_lock = asyncio.Lock()
        self._last_refresh_at: float | None = None
        # Config reloads and DNS rounds both rebuild the list: one at a time, or one could
        # drop what the other just added.
        self._apply_lock = asyncio.Lock()

    @classmethod
    def from_config(
        cls, config: ClientConfig, discovery: DNSDiscovery | None = None
    ) -> BackendRegistry:
        """One backend per configured server URL (CB servers first), then one per jumper key.

        Servers named by DNS join at :meth:`start`, when the first resolution has been done.
        """
        registry = cls([], discovery=discovery)
        registry.config = config
        if config.shared_state_url:
            registry.shared_state = SharedBreakerState(config.shared_state_url)
        registry.backends, _ = registry._build(config)
        return registry

    async def apply_config(self, config: ClientConfig) -> list[Backend]:
        """Make the backend list match ``config`` (and its DNS names); returns the new ones.

        New backends are health-checked before they join, so that a request arriving just
        after the switch finds them ready. Backends that stay keep their state (health,
        load, circuit, key rest); removed ones simply leave the list, so requests in flight
        there finish normally (they hold their own reference).
        """
        self.config = config
        effective = await self.discovery.effective_config(config, config.health_timeout_seconds)
        return await self._apply(effective, is_probing_new=True)

    async def rediscover(self) -> list[Backend]:
        """Resolve the config's DNS names again and apply the result; returns the new backends.

        New servers join the list unchecked (so not routable: a backend starts unhealthy) and
        the heartbeat's health check that follows lets them in; vanished ones leave as on a
        config reload. Without DNS names this does nothing.
        """
        config = self.config
        if config is None or not config.dns_entries:
            return []
        effective = await self.discovery.effective_config(config, config.health_timeout_seconds)
        return await self._apply(effective, is_probing_new=False)

    async def _apply(self, effective: ClientConfig, *, is_probing_new: bool) -> list[Backend]:
        async with self._apply_lock:
            backends, new = self._build(effective)
            if is_probing_new:
                await self.probe(new)
            for backend in self.backends:
                if backend not in backends:
                    logger.info(
                        "backend %s removed (requests in flight there finish)", backend.name
                    )
            self.backends = backends
            return new

    def _build(self, config: ClientConfig) -> tuple[list[Backend], list[Backend]]:
        """The backend list for ``config`` (reusing current backends) and which are new.

        Settings such as thresholds apply to every backend at once.
        """
        self.health_timeout_seconds = config.health_timeout_seconds
        self.heartbeat_interval_seconds = config.heart_beat_interval_seconds
        current = {backend.identity: backend for backend in self.backends}
        backends: list[Backend] = []
        for fresh in backends_from_config(config):
            kept = current.get(fresh.identity)
            if kept is not None:  # same server or key: keep its state, take the new settings
                kept.adopt_settings(fresh)
            backends.append(kept or fresh)
        for backend in backends:
            health = backend.health
            health.num_failures_to_mark_down = config.num_failures_to_mark_down
            health.breaker.failure_threshold = config.circuit_breaker_failures
            health.breaker.cooldown_seconds = config.circuit_breaker_cooldown_seconds
        new = [backend for backend in backends if backend not in self.backends]
        if self.shared_state is not None:
            self.shared_state.attach(new)
        return backends, new

    # -- life cycle ------------------------------------------------------------------------

    async def start(self, client: httpx.AsyncClient) -> None:
        """Check every backend once, then keep checking in the background (and, with shared
        state, keep applying the other replicas' circuit openings)."""
        self._client = client
        if self.shared_state is not None:
            self.shared_state.start(lambda: self.backends)
        await self.rediscover()
        await self.refresh()
        healthy = self.healthy()
        if self.backends and not healthy:
            logger.warning(
                "no backend is healthy yet (%d configured); checking again every %.1f s",
                len(self.backends),
                self.heartbeat_interval_seconds,
            )
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")

    async def stop(self) -> None:
        """Cancel the background refresh (and the shared-state sync) and wait for them."""
        task, self._heartbeat_task = self._heartbeat_task, None
        await cancel_and_wait(task)
        if self.shared_state is not None:
            await self.shared_state.stop()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_seconds)
            try:
                await self.rediscover()
                await self.refresh()
            except Exception:  # a bug in one round must not end the heartbeat for good
                logger.exception("health refresh failed")

    # -- refresh ---------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Ask every backend for its health concurrently (each bounded by the health timeout)."""
        async with self._refresh_lock:
            await self._refresh_locked()

    async def refresh_if_stale(self) -> None:
        """Refresh unless one finished very recently; concurrent callers share one refresh."""
        async with self._refresh_lock:
            last = self._last_refresh_at
            if last is None or time.monotonic() - last >= self.lazy_refresh_min_interval_seconds:
                await self._refresh_locked()

    async def _refresh_locked(self) -> None:
        if self._client is None:
            raise RuntimeError("BackendRegistry.start() has not been called")
        client, timeout = self._client, self.health_timeout_seconds
        await asyncio.gather(*(backend.probe(client, timeout) for backend in self.backends))
        self._last_refresh_at = time.monotonic()

    async def probe(self, backends: list[Backend]) -> None:
        """Check some backends now (e.g. the ones a config reload added)."""
        if self._client is not None and backends:
            client, timeout = self._client, self.health_timeout_seconds
            await asyncio.gather(*(backend.probe(client, timeout) for backend in backends))

    # -- lookup ----------------------------------------------------------------------------

    def healthy(self) -> list[Backend]:
        """Backends that take requests now (healthy, circuit not open)."""
        now = time.monotonic()
        return [backend for backend in self.backends if backend.health.is_routable(now)]

    def candidates(
        self,
        request: GatewayRequest,
        exclude: Container[Backend] = (),
        plans: PlanMemo | None = None,
    ) -> list[Backend]:
        """Backends that can take the request now, best tier only.

        Tiers (each kind says its own): first (CB, Triton, embedding servers, engines), second
        (SB servers), fallback (jumpers, unless the route is ``local``); a lower tier is used
        only when no backend of a higher one can take the request. ``exclude`` drops backends
        this request may not use (failover: those tried); ``plans`` keeps the plans of the
        backends asked (a fresh memo when not given).
        """
        model, route = request.model, request.route
        plans = PlanMemo(request) if plans is None else plans
        eligible = [
            backend
            for backend in self.healthy()
            if backend not in exclude
            and route_allows(route, backend.is_fallback)
            and (model is None or backend.serves(model))
        ]
        # Tier by tier, so that a backend kind is asked about the request (and builds its
        # translation) only when no backend of a better tier can take it.
        for tier in sorted({backend.priority for backend in eligible}):
            accepted = [
                backend
                for backend in eligible
                if backend.priority == tier and plans.plan(backend).is_accepted
            ]
            if accepted:
                return accepted
        return []

    def model_ids(self, *, is_healthy_only: bool = True) -> list[str]:
        """Model ids served by the (healthy) backends, each once, in configuration order.

        Jumpers count with the models their entries list (an entry listing none serves any
        model the caller names, and adds nothing here).
        """
        backends = self.healthy() if is_healthy_only else self.backends
        seen: dict[str, None] = {}
        for backend in backends:
            seen.update(dict.fromkeys(backend.health.model_ids))
        return list(seen)

    def max_model_len(self, model: str) -> int | None:
        """The context length a healthy server reports for ``model`` (the smallest if several)."""
        lengths = [
            backend.health.max_model_len
            for backend in self.healthy()
            if backend.serves(model) and backend.health.max_model_len is not None
        ]
        return min(lengths) if lengths else None
