"""Triton Inference Server (e.g. Triton + TensorRT-LLM) as a backend of the gateway.

Heartbeats use Triton's ready endpoints (``/v2/health/ready``, then ``/v2/models/{m}/ready``
for each configured model). Native requests, and OpenAI requests with a native equivalent, go
through Triton's generate extension (``client.backends.native_to_triton``) and come back in
the caller's shape. Balancing, failover and the circuit breaker treat a Triton server like our
own servers.

What Triton cannot take never goes there: chats unless the entry names a chat template to
render them with (TensorRT-LLM applies none), several prompts or token-id prompts, and
decoding options its ensemble lacks.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
from pydantic import ValidationError

from client.backends.base import Backend, Plan
from client.backends.chat_templates import preload
from client.backends.native_answers_to_openai import CHAT_PATH, COMPLETIONS_PATH, OpenAIShaper
from client.backends.native_to_triton import NativeToTriton
from client.config.schema import TritonServerConfig
from client.gateway_request import GatewayRequest
from protocol.health import LoadReport

#: The caller endpoints a Triton server answers (through translation).
TRITON_PATHS = ("/generate", COMPLETIONS_PATH, CHAT_PATH)


@dataclass(eq=False)
class TritonBackend(Backend):
    """One Triton server and the models it serves under Triton names."""

    config: TritonServerConfig = field(kw_only=True)

    @classmethod
    def from_config(cls, config: TritonServerConfig) -> TritonBackend:
        """The backend for one entry of ``triton_server_urls``."""
        return cls(url=config.url, kind="triton", config=config)

    def adopt_settings(self, fresh: Backend) -> None:
        """The same server from a reloaded config: take its entry (model names, template)."""
        assert isinstance(fresh, TritonBackend)
        self.config = fresh.config

    def triton_model(self, model: str | None) -> str:
        """The Triton name of the gateway's ``model`` (no model: the first configured)."""
        if model is None or model not in self.config.models:
            return next(iter(self.config.models.values()))
        return self.config.models[model]

    def plan(self, request: GatewayRequest) -> Plan:
        """Requests with a native equivalent whose decoding Triton can express, through
        Triton's generate API; chats only when the entry names a chat template to render them
        with."""
        if request.endpoint not in TRITON_PATHS:
            return Plan(refusal=f"Triton servers do not answer {request.endpoint}")
        native = request.native
        if native is None:
            return Plan(
                refusal="Triton servers take one text prompt or one conversation per request"
            )
        if native.messages is not None and not self.config.chat_template_from:
            return Plan(
                refusal=f"Triton server {self.url} takes text, not messages (set "
                "'chat_template_from' in its entry to render chats)"
            )
        model = request.model
        shaper = None
        if request.endpoint != "/generate":  # answer in the OpenAI shape the caller asked for
            name = model or self.triton_model(model)
            shaper = OpenAIShaper(request.endpoint, name, request.is_usage_streamed)
        try:
            translation = NativeToTriton(
                native, self.triton_model(model), model, self.config, shaper
            )
        except (ValueError, ValidationError) as exc:
            return Plan(refusal=str(exc).splitlines()[0])
        return Plan(translation=translation)

    async def probe(self, client: httpx.AsyncClient, timeout_seconds: float) -> None:
        """Server readiness, then each configured model's; never raises for network trouble."""
        try:
            response = await client.get(self.url_for("/v2/health/ready"), timeout=timeout_seconds)
        except httpx.HTTPError as exc:
            self.record_failed_heartbeat(f"GET /v2/health/ready failed: {type(exc).__name__}")
            return
        if response.status_code != 200:
            self.record_failed_heartbeat(f"GET /v2/health/ready answered {response.status_code}")
            return
        names = list(self.config.models.items())
        ready = await asyncio.gather(
            *(self._is_model_ready(client, triton, timeout_seconds) for _, triton in names)
        )
        model_ids = [ours for (ours, _), is_ready in zip(names, ready, strict=True) if is_ready]
        # A server whose models are still loading answers ready: it is "loading" until one is.
        status = "ok" if model_ids else "loading"
        if model_ids and self.config.chat_template_from and not self.is_healthy:
            await preload(self.config.chat_template_from)  # off the loop, before traffic
        self.record_health(status, model_ids or list(self.config.models), None, LoadReport())

    async def _is_model_ready(
        self, client: httpx.AsyncClient, triton_model: str, timeout_seconds: float
    ) -> bool:
        try:
            path = f"/v2/models/{triton_model}/ready"
            response = await client.get(self.url_for(path), timeout=timeout_seconds)
        except httpx.HTTPError:
            return False
        return response.status_code == 200
