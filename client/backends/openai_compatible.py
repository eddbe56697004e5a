"""OpenAI-compatible engines (``vllm serve``, llama.cpp's ``llama-server``, SGLang, TGI, another
of our gateways) as first-tier servers of the gateway.

Unlike an OpenAI jumper, an engine is a server: it is heart-beaten (its ``health_path``, else
``GET /v1/models``), the models it serves are learnt from ``/v1/models`` unless the entry lists
them, and its load comes from vLLM's queue gauges on its ``/metrics`` when it exports them
(else the policies see the gateway's own in-flight count alone). Balancing, the circuit breaker
and failover treat it as one of our CB servers.

OpenAI requests go as sent; native ``/generate`` requests (and the Triton API's, which arrive
as native ones) go through the translation the jumpers use, unless they use what the OpenAI
API cannot express: then the engine declines, and the request goes to another server or gets
the 503 naming the fields.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
from pydantic import ValidationError

from client.backends.base import AS_SENT, Backend, Plan
from client.backends.native_to_openai import NativeToOpenAI, upstream_unsupported_fields
from client.backends.prometheus_load import load_from_metrics
from client.backends.translation import SecretScrubber, StreamTranslator
from client.config.engines import OpenAICompatibleServerConfig
from client.gateway_request import GatewayRequest
from protocol.health import LoadReport
from protocol.openai_api import ModelList

#: Caller endpoints an engine answers as they are.
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
#: Caller endpoints an engine answers through translation to the OpenAI API.
TRANSLATED_PATHS = ("/generate",)


class _ProbeFailed(Exception):
    """A heartbeat that found the engine unreachable, or answering something else than 200."""


@dataclass(eq=False)
class OpenAICompatibleServer(Backend):
    """One OpenAI-compatible engine, balanced with our own CB servers."""

    config: OpenAICompatibleServerConfig = field(kw_only=True)

    def __post_init__(self) -> None:
        # Listed models count before the first heartbeat, so that a request for one of them
        # while the engine is down gets "try later" (503) rather than "no such model" (404).
        self.model_ids = list(self.config.models)

    @classmethod
    def from_config(cls, config: OpenAICompatibleServerConfig) -> OpenAICompatibleServer:
        """The backend for one entry of ``openai_compatible_server_urls``."""
        return cls(url=config.url, kind="openai_compatible", config=config)

    def adopt_settings(self, fresh: Backend) -> None:
        """The same engine from a reloaded config: take its entry (models, key, health path)."""
        assert isinstance(fresh, OpenAICompatibleServer)
        self.config = fresh.config
        if fresh.config.models:
            self.model_ids = list(fresh.config.models)

    def plan(self, request: GatewayRequest) -> Plan:
        """OpenAI requests as sent; native ones through the OpenAI API when it can say the
        same; nothing else."""
        if request.endpoint in OPENAI_PATHS:
            return AS_SENT
        if request.endpoint not in TRANSLATED_PATHS or request.native is None:
            return Plan(refusal=f"OpenAI-compatible engines do not answer {request.endpoint}")
        unsupported = upstream_unsupported_fields(request.native)
        if unsupported:
            return Plan(refusal=f"OpenAI-compatible engines cannot honour {', '.join(unsupported)}")
        # Triton's "ensemble" alias names no model; vLLM insists on one: its first model.
        model = request.model or next(iter(self.model_ids), None)
        return Plan(translation=NativeToOpenAI(request.native, model, request.model))

    def request_headers(self) -> dict[str, str]:
        """The engine's bearer key, when its entry has one."""
        if self.config.api_key is None:
            return {}
        return {"authorization": f"Bearer {self.config.api_key.get_secret_value()}"}

    def _key(self) -> str:
        return "" if self.config.api_key is None else self.config.api_key.get_secret_value()

    def stream_filter(self, translator: StreamTranslator | None) -> StreamTranslator | None:
        """Streams are scrubbed of the engine's key (an error event may quote it)."""
        key = self._key()
        return SecretScrubber(key, translator) if key else translator

    def scrub(self, text: str) -> str:
        """``text`` with the engine's key masked."""
        key = self._key()
        return text.replace(key, "***") if key else text

    async def probe(self, client: httpx.AsyncClient, timeout_seconds: float) -> None:
        """Heartbeat: the health path (else ``/v1/models``), the model list and the metrics,
        concurrently; never raises for network trouble (it marks the engine down)."""
        health_path = self.config.health_path
        calls = [self._get(client, "/v1/models", timeout_seconds)]
        if health_path is not None:
            calls.append(self._get(client, health_path, timeout_seconds))
        metrics, *answers = await asyncio.gather(
            self._metrics(client, timeout_seconds), *calls, return_exceptions=True
        )
        listed, health = answers[0], answers[-1]  # the same call without a health path
        for result in (metrics, *answers):
            if isinstance(result, BaseException) and not isinstance(result, _ProbeFailed):
                raise result
        if isinstance(health, _ProbeFailed):
            self.record_failed_heartbeat(str(health))
            return
        model_ids, max_model_len = self._models_of(listed)
        if not model_ids and not self.config.models:
            # Alive, but nothing says which models: not routable until /v1/models answers.
            self.record_health("loading", [], None, LoadReport())
            return
        load = metrics if isinstance(metrics, LoadReport) else LoadReport()
        self.record_health("ok", list(self.config.models) or model_ids, max_model_len, load)

    def _models_of(self, listed: object) -> tuple[list[str], int | None]:
        """Model ids and the context length (of the first served model) from ``/v1/models``."""
        if not isinstance(listed, httpx.Response):
            return [], None
        try:
            cards = ModelList.model_validate_json(listed.content).data
        except ValidationError:
            return [], None
        wanted = set(self.config.models)
        lengths = [c.max_model_len for c in cards if not wanted or c.id in wanted]
        return [card.id for card in cards], next((n for n in lengths if n), None)

    async def _get(
        self, client: httpx.AsyncClient, path: str, timeout_seconds: float
    ) -> httpx.Response:
        try:
            response = await client.get(
                self.url_for(path), headers=self.request_headers(), timeout=timeout_seconds
            )
        except httpx.HTTPError as exc:
            raise _ProbeFailed(f"GET {path} failed: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise _ProbeFailed(f"GET {path} answered HTTP {response.status_code}")
        return response

    async def _metrics(self, client: httpx.AsyncClient, timeout_seconds: float) -> LoadReport:
        """vLLM's queue gauges; an engine without them reports no load (``_ProbeFailed``)."""
        response = await self._get(client, "/metrics", timeout_seconds)
        load = load_from_metrics(response.text)
        if load is None:
            raise _ProbeFailed("no vLLM queue gauges on /metrics")
        return load
