"""Triton Inference Server (e.g. Triton + TensorRT-LLM) as a backend of the gateway.

Heartbeats use Triton's ready endpoints (``/v2/health/ready``, then ``/v2/models/{m}/ready``
for each configured model). A Triton caller's request goes as it came (only the model name in
the path becomes the server's); native requests go through Triton's generate extension
(``client.triton.to_triton``), and OpenAI requests through their native form, coming back in
the caller's shape. Balancing, failover and the circuit breaker treat a Triton server like our
own servers (first tier).

What Triton cannot take never goes there: chats unless the entry names a chat template to
render them with (TensorRT-LLM applies none), several prompts or token-id prompts, and
decoding options its ensemble lacks.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import ValidationError

from client.backends.backend import Backend, without_native_form
from client.backends.plan import Plan
from client.config.schema_common import ServerDNSConfig
from client.endpoints import Api
from client.gateway_request import GatewayRequest
from client.triton.call import TritonCall
from client.triton.chat_templates import preload
from client.triton.config import TritonSection, TritonServerConfig
from client.triton.to_triton import NativeToTriton
from protocol.health import LoadReport


@dataclass(eq=False)
class TritonServer(Backend):
    """One Triton server and the models it serves under Triton names."""

    kind = "triton"
    noun = "Triton server"
    section = TritonSection
    apis = frozenset[Api]({"native", "triton"})

    config: TritonServerConfig = field(kw_only=True)

    @classmethod
    def from_entry(cls, entry: TritonServerConfig) -> TritonServer:
        """The backend for one entry of ``triton_server_urls``."""
        return cls(url=entry.url, config=entry)

    @classmethod
    def from_config(cls, config: TritonSection) -> list[Backend]:
        """One backend per entry of ``triton_server_urls``."""
        return [cls.from_entry(entry) for entry in config.triton_server_urls]

    @classmethod
    def listed_urls(cls, config: TritonSection) -> list[str]:
        """The entries' URLs."""
        return [entry.url for entry in config.triton_server_urls]

    @classmethod
    def dns_entry(cls, config: TritonSection) -> ServerDNSConfig | None:
        """``triton_server_dns``."""
        return config.triton_server_dns

    @classmethod
    def with_discovered(cls, config: TritonSection, urls: list[str]) -> dict[str, Any]:
        """An entry per discovered server, with the DNS entry's model names."""
        dns = config.triton_server_dns
        if dns is None or not urls:
            return {}
        return {"triton_server_urls": [*config.triton_server_urls, *map(dns.server_config, urls)]}

    def adopt_settings(self, fresh: Backend) -> None:
        """The same server from a reloaded config: take its entry (model names, template)."""
        assert isinstance(fresh, TritonServer)
        self.config = fresh.config

    def triton_model(self, model: str | None) -> str:
        """The Triton name of the gateway's ``model`` (no model: the first configured)."""
        if model is None or model not in self.config.models:
            return next(iter(self.config.models.values()))
        return self.config.models[model]

    def plan(self, request: GatewayRequest) -> Plan:
        """A Triton call as it came (the path naming the server's model); a native request
        through Triton's generate API when Triton can express its decoding, chats only when the
        entry names a chat template to render them with."""
        if request.endpoint.api == "triton":  # the same API: passes through untouched
            call = request.parsed
            assert isinstance(call, TritonCall)
            return Plan(path=call.path_for(self.triton_model(request.model)))
        native = request.native
        if native is None:
            return without_native_form(request, self.noun)
        if native.messages is not None and not self.config.chat_template_from:
            return Plan(
                refusal=f"Triton server {self.url} takes text, not messages (set "
                "'chat_template_from' in its entry to render chats)"
            )
        model = request.model
        try:
            translation = NativeToTriton(native, self.triton_model(model), model, self.config)
        except (ValueError, ValidationError) as exc:
            return Plan(refusal=str(exc).splitlines()[0])
        return Plan(translation=translation)

    async def probe(self, client: httpx.AsyncClient, timeout_seconds: float) -> None:
        """Server readiness, then each configured model's; never raises for network trouble."""
        try:
            response = await client.get(self.url_for("/v2/health/ready"), timeout=timeout_seconds)
        except httpx.HTTPError as exc:
            self.health.record_failed_heartbeat(
                f"GET /v2/health/ready failed: {type(exc).__name__}"
            )
            return
        if response.status_code != 200:
            self.health.record_failed_heartbeat(
                f"GET /v2/health/ready answered {response.status_code}"
            )
            return
        names = list(self.config.models.items())
        ready = await asyncio.gather(
            *(self._is_model_ready(client, triton, timeout_seconds) for _, triton in names)
        )
        model_ids = [ours for (ours, _), is_ready in zip(names, ready, strict=True) if is_ready]
        # A server whose models are still loading answers ready: it is "loading" until one is.
        status = "ok" if model_ids else "loading"
        if model_ids and self.config.chat_template_from and not self.health.is_healthy:
            await preload(self.config.chat_template_from)  # off the loop, before traffic
        self.health.record_health(status, model_ids or list(self.config.models), None, LoadReport())

    async def _is_model_ready(
        self, client: httpx.AsyncClient, triton_model: str, timeout_seconds: float
    ) -> bool:
        try:
            path = f"/v2/models/{triton_model}/ready"
            response = await client.get(self.url_for(path), timeout=timeout_seconds)
        except httpx.HTTPError:
            return False
        return response.status_code == 200
