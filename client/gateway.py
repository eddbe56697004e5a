"""The gateway as one object: config, backends, routing, proxy and metrics, started and stopped
together by the app's lifespan."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
from pydantic import BaseModel

from client.backends.status import BackendStatus, status_of
from client.balancing.policies import make_policy
from client.balancing.registry import BackendRegistry
from client.balancing.router import Router
from client.config.schema import ClientConfig
from client.config.watch import ConfigWatcher
from client.forwarding.failover import Proxy
from client.metrics import GatewayMetrics
from protocol.health import HealthResponse, LoadReport, ServerKind
from protocol.openai_api import ModelCard, ModelList
from utils.http_transport import ResetSafeTransport

logger = logging.getLogger(__name__)

#: Upstream connection pool. Streams hold a connection for their whole length, so the pool is
#: sized for many concurrent generations rather than httpx's default of 100.
MAX_UPSTREAM_CONNECTIONS = 1000
MAX_KEEPALIVE_CONNECTIONS = 100


class BackendTable(BaseModel):
    """Answer of ``GET /backends``."""

    backends: list[BackendStatus]


class GatewayHealth(HealthResponse):
    """Answer of the gateway's ``GET /health``: its own liveness plus every backend's health."""

    kind: ServerKind = "gateway"
    num_healthy_backends: int
    backends: list[BackendStatus]


class Gateway:
    """Owns the gateway's parts; :meth:`start` and :meth:`stop` run in the app lifespan.

    ``config_path`` enables config reload: the file is watched, and :meth:`reload` re-reads it
    (the app calls it on SIGHUP when it runs on its own).
    """

    def __init__(self, config: ClientConfig, config_path: str | Path | None = None) -> None:
        self.config = config
        self.registry = BackendRegistry.from_config(config)
        self.router = Router(self.registry, make_policy(config))
        self.metrics = GatewayMetrics(self.registry)
        self._watcher = (
            ConfigWatcher(config_path, config, self.apply_config) if config_path else None
        )
        self._clients: list[httpx.AsyncClient] = []
        self._proxy: Proxy | None = None

    @property
    def proxy(self) -> Proxy:
        """The request forwarder (exists between :meth:`start` and :meth:`stop`)."""
        if self._proxy is None:
            raise RuntimeError("the gateway has not been started")
        return self._proxy

    async def start(self) -> None:
        """Open the upstream clients, check the backends, start the heartbeat and the watch."""
        limits = httpx.Limits(
            max_connections=MAX_UPSTREAM_CONNECTIONS,
            max_keepalive_connections=MAX_KEEPALIVE_CONNECTIONS,
        )
        # Timeouts are set per request from the current config (they may be reloaded).
        # trust_env=False for our servers: they are on the local network, and an
        # HTTP(S)_PROXY meant for the outside world must not capture these calls. The jumpers
        # are the outside world, so their client honours it.
        local_client = httpx.AsyncClient(
            transport=ResetSafeTransport(limits=limits), trust_env=False
        )
        upstream_client = httpx.AsyncClient(
            transport=ResetSafeTransport(limits=limits, trust_env=True), trust_env=True
        )
        self._clients = [local_client, upstream_client]
        self._proxy = Proxy(local_client, upstream_client, self.router, self.metrics, self.config)
        self._log_jumpers(self.config)
        await self.registry.start(local_client)
        if self._watcher is not None:
            self._watcher.start()
        healthy = self.registry.healthy()
        logger.info(
            "gateway started: %d backend(s), %d healthy, models %s, policy %s",
            len(self.registry.backends),
            len(healthy),
            self.registry.model_ids(),
            self.config.balancing_policy,
        )

    async def stop(self) -> None:
        """Stop the watch and the heartbeat, close the upstream clients."""
        if self._watcher is not None:
            await self._watcher.stop()
        await self.registry.stop()
        for client in self._clients:
            await client.aclose()
        self._clients = []
        self._proxy = None

    async def reload(self) -> bool:
        """Re-read the config file now; True when a changed, valid config was applied."""
        if self._watcher is None:
            return False
        return await self._watcher.reload()

    async def apply_config(self, config: ClientConfig) -> None:
        """Switch to ``config`` without dropping requests in flight.

        Backends that stay keep their state; new ones are checked at once; removed ones get no
        new requests, while those in flight there finish.
        """
        if config.balancing_policy != self.config.balancing_policy or (
            config.affinity_max_imbalance != self.config.affinity_max_imbalance
        ):
            self.router.policy = make_policy(config)
        if config.shared_state_url != self.config.shared_state_url:
            logger.warning("shared_state_url changes take effect at the next restart")
        new_backends = await self.registry.apply_config(config)
        self.config = config
        if self._proxy is not None:
            self._proxy.config = config
        self._log_jumpers(config)
        logger.info(
            "config applied: %d backend(s) (%d new), %d healthy, policy %s",
            len(self.registry.backends),
            len(new_backends),
            len(self.registry.healthy()),
            config.balancing_policy,
        )

    @staticmethod
    def _log_jumpers(config: ClientConfig) -> None:
        jumpers = config.openai_jumper_configs
        if not jumpers:
            return
        num_enabled = len(config.enabled_jumpers)
        # Never log the entries themselves: they hold API keys.
        logger.info(
            "%d OpenAI jumper key(s) configured, %d usable (%d with a placeholder key, disabled)",
            len(jumpers),
            num_enabled,
            len(jumpers) - num_enabled,
        )

    def backend_table(self) -> BackendTable:
        """Every backend's status."""
        return BackendTable(backends=[status_of(backend) for backend in self.registry.backends])

    def health(self) -> GatewayHealth:
        """The gateway's own health report; its load is the total in flight."""
        backends = self.registry.backends
        return GatewayHealth(
            status="ok",
            load=LoadReport(num_running=sum(backend.num_in_flight for backend in backends)),
            num_healthy_backends=len(self.registry.healthy()),
            backends=[status_of(backend) for backend in backends],
        )

    async def model_list(self) -> ModelList:
        """The models of the healthy backends and jumpers, each once (refreshing first if no
        local server is up)."""
        if all(backend.is_fallback for backend in self.registry.healthy()):
            await self.registry.refresh_if_stale()
        return ModelList(
            data=[
                ModelCard(
                    id=model,
                    max_model_len=self.registry.max_model_len(model),
                    owned_by=self._owner(model),
                )
                for model in self.registry.model_ids()
            ]
        )

    def _owner(self, model: str) -> str:
        is_served = any(not b.is_fallback and b.serves(model) for b in self.registry.healthy())
        return "llm-serving-suite" if is_served else "openai-jumper"
