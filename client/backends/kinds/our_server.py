"""What our own servers (continuous batching, static batching, embedding) share as backends:
a URL list in the config (entries may name deployment apps), an optional DNS name, and the
heartbeat on their ``GET /health`` and ``GET /v1/models``."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx
from pydantic import BaseModel, Field, ValidationError, create_model

from client.backends.backend import Backend
from client.backends.plan import AS_SENT, Plan
from client.config.schema_common import ServerAddress, ServerDNSConfig
from client.endpoints import Endpoint
from client.gateway_request import GatewayRequest
from protocol.health import HealthResponse
from protocol.openai_api import ModelList

logger = logging.getLogger(__name__)


def server_list_section(
    name: str, urls_key: str, description: str, dns_key: str = ""
) -> type[BaseModel]:
    """The gateway config's keys for one kind of our servers (the model called ``name``): the
    list ``urls_key`` (URLs or deployment app names, ``description`` saying which servers) and,
    with a ``dns_key``, a DNS name to find more of them through."""
    fields: dict[str, Any] = {
        urls_key: (list[ServerAddress], Field(default_factory=list, description=description))
    }
    if dns_key:
        fields[dns_key] = (ServerDNSConfig | None, None)
    doc = f"The gateway config's keys for {description.split(',')[0]}."
    return create_model(name, __doc__=doc, **fields)


class _ProbeError(Exception):
    """A health check that found the server unreachable or answering nonsense."""


@dataclass(eq=False)
class OurServer(Backend):
    """One of our servers, listed by URL (or app name) under ``urls_key`` and found through
    DNS under ``dns_key``; it reports its kind, models and load on ``/health``.

    The config hooks read the kind's section (any config model holding it) by those keys.
    """

    #: The config key listing these servers' URLs (or deployment app names).
    urls_key: ClassVar[str]
    #: The config key naming a DNS name these servers are found through ("": none).
    dns_key: ClassVar[str] = ""

    @classmethod
    def from_config(cls, config: BaseModel) -> list[Backend]:
        """One backend per listed URL."""
        return [cls(url=url) for url in getattr(config, cls.urls_key)]

    @classmethod
    def listed_urls(cls, config: BaseModel) -> list[str]:
        """The URLs under ``urls_key``."""
        return list(getattr(config, cls.urls_key))

    @classmethod
    def app_name_keys(cls) -> tuple[str, ...]:
        """``urls_key``: its entries may be deployment app names."""
        return (cls.urls_key,)

    @classmethod
    def dns_entry(cls, config: BaseModel) -> ServerDNSConfig | None:
        """The entry under ``dns_key``, if the config has one."""
        return getattr(config, cls.dns_key) if cls.dns_key else None

    @classmethod
    def with_discovered(cls, config: BaseModel, urls: list[str]) -> dict[str, Any]:
        """The URL list with the discovered servers appended."""
        return {cls.urls_key: [*getattr(config, cls.urls_key), *urls]} if urls else {}

    def plan(self, request: GatewayRequest) -> Plan:
        """Generation requests go as the caller sent them; our generation servers do not
        embed."""
        if request.endpoint == Endpoint.EMBEDDINGS:
            return Plan(refusal=f"{self.noun}s do not embed")
        if request.endpoint == Endpoint.RELAYED:
            return Plan(refusal=f"{self.noun}s answer their own endpoints only")
        return AS_SENT

    async def probe(self, client: httpx.AsyncClient, timeout_seconds: float) -> None:
        """Ask the server for ``/health`` and ``/v1/models`` and record the answer."""
        # Both calls are bounded by the timeout, so waiting for the pair costs no extra time.
        health, listed_model_ids = await asyncio.gather(
            self._get_health(client, timeout_seconds),
            self._get_model_ids(client, timeout_seconds),
            return_exceptions=True,
        )
        if isinstance(health, BaseException):
            if not isinstance(health, _ProbeError):
                raise health
            self.health.record_failed_heartbeat(str(health))
            return
        if isinstance(listed_model_ids, BaseException):
            raise listed_model_ids
        self.apply_health(health, listed_model_ids)

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
        self.health.record_health(health.status, model_ids, health.max_model_len, health.load)

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
