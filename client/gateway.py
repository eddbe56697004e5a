"""The gateway as one object: config, backends, routing, proxy and metrics, started and stopped
together by the app's lifespan."""

from __future__ import annotations

import logging

import httpx
from pydantic import BaseModel

from client.backends import BackendStatus
from client.config import ClientConfig
from client.metrics import GatewayMetrics
from client.policies import make_policy
from client.proxy import Proxy
from client.registry import BackendRegistry
from client.routing import Router
from protocol.health import HealthResponse, LoadReport, ServerKind
from protocol.openai_api import ModelCard, ModelList

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
    """Owns the gateway's parts; :meth:`start` and :meth:`stop` run in the app lifespan."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.registry = BackendRegistry.from_config(config)
        self.router = Router(self.registry, make_policy(config.balancing_policy))
        self.metrics = GatewayMetrics(self.registry)
        self._client: httpx.AsyncClient | None = None
        self._proxy: Proxy | None = None

    @property
    def proxy(self) -> Proxy:
        """The request forwarder (exists between :meth:`start` and :meth:`stop`)."""
        if self._proxy is None:
            raise RuntimeError("the gateway has not been started")
        return self._proxy

    async def start(self) -> None:
        """Open the shared upstream client, check the backends, start the heartbeat."""
        config = self.config
        timeout = httpx.Timeout(
            connect=config.connect_timeout_seconds,
            # The read timeout bounds the silence between two chunks, so a long stream that
            # keeps producing is never cut, while a stuck server is.
            read=config.request_timeout_seconds,
            write=config.request_timeout_seconds,
            pool=config.connect_timeout_seconds,
        )
        limits = httpx.Limits(
            max_connections=MAX_UPSTREAM_CONNECTIONS,
            max_keepalive_connections=MAX_KEEPALIVE_CONNECTIONS,
        )
        # trust_env=False: the model servers are on the local network; an HTTP(S)_PROXY meant
        # for the outside world must not capture these calls.
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
        self._proxy = Proxy(self._client, self.router, self.metrics)
        self._log_jumpers()
        await self.registry.start(self._client)
        healthy = self.registry.healthy()
        logger.info(
            "gateway started: %d backend(s), %d healthy, models %s, policy %s",
            len(self.registry.backends),
            len(healthy),
            self.registry.model_ids(),
            config.balancing_policy,
        )

    async def stop(self) -> None:
        """Stop the heartbeat and close the upstream client."""
        await self.registry.stop()
        if self._client is not None:
            await self._client.aclose()
        self._client = None
        self._proxy = None

    def _log_jumpers(self) -> None:
        jumpers = self.config.openai_jumper_configs
        if not jumpers:
            return
        num_enabled = len(self.config.enabled_jumpers)
        # Never log the entries themselves: they hold API keys.
        logger.info(
            "%d OpenAI jumper(s) configured, %d with a placeholder key (disabled); routing to "
            "OpenAI-compatible upstreams is not part of this version",
            len(jumpers),
            len(jumpers) - num_enabled,
        )

    def backend_table(self) -> BackendTable:
        """Every backend's status."""
        return BackendTable(backends=[backend.status() for backend in self.registry.backends])

    def health(self) -> GatewayHealth:
        """The gateway's own health report; its load is the total in flight."""
        backends = self.registry.backends
        return GatewayHealth(
            status="ok",
            load=LoadReport(num_running=sum(backend.num_in_flight for backend in backends)),
            num_healthy_backends=len(self.registry.healthy()),
            backends=[backend.status() for backend in backends],
        )

    async def model_list(self) -> ModelList:
        """The models of the healthy backends, each once (refreshing first if none is up)."""
        if not self.registry.healthy():
            await self.registry.refresh_if_stale()
        return ModelList(
            data=[
                ModelCard(id=model, max_model_len=self.registry.max_model_len(model))
                for model in self.registry.model_ids()
            ]
        )
