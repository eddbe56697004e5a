"""OpenAI-compatible upstreams: engines (vLLM, llama.cpp, SGLang, TGI, another of our gateways)
and metered accounts ("OpenAI jumpers"), one kind with a tier setting.

OpenAI requests go as sent; native ``/generate`` requests (and the Triton API's, which arrive
as native ones) go through the OpenAI API (``client.backends.native_to_openai``) unless they use
what it cannot express: then the upstream declines, and the request goes to another backend or
gets the 503 naming the fields. The entry's key is sent as a bearer token and masked in
everything that comes back.

In the first or second tier an upstream is a server: heart-beaten, balanced with ours, marked
down when unreachable. In the fallback tier it is an account: no heartbeat (it would spend
quota), the least recently used key first, and a key that answers 429/5xx rests for the
upstream's Retry-After or ``jumper_cooldown_seconds``; one that is refused (401/403) rests much
longer. Accounts are named by position and base URL, never by key.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
from pydantic import BaseModel, Field, ValidationError

from client.backends.backend import Backend, Tier, without_native_form
from client.backends.kinds.openai_compatible_config import (
    OpenAICompatibleConfig,
    OpenAIJumperConfig,
)
from client.backends.native_to_openai import NativeToOpenAI, upstream_unsupported_fields
from client.backends.plan import AS_SENT, Plan
from client.backends.prometheus_load import load_from_metrics
from client.endpoints import Endpoint
from client.gateway_request import GatewayRequest
from protocol.health import LoadReport
from protocol.openai_api import ModelList

#: How long a key rests after the upstream refused it (401/403): a wrong or revoked key will
#: not heal by itself, but a config reload replaces it without waiting.
REFUSED_KEY_COOLDOWN_SECONDS = 600.0
#: Upstream statuses that mean the key is not accepted.
REFUSED_KEY_STATUSES = (401, 403)


class OpenAICompatibleSection(BaseModel):
    """The gateway config's keys for OpenAI-compatible upstreams."""

    openai_compatible_server_urls: list[OpenAICompatibleConfig] = Field(
        default_factory=list,
        description="OpenAI-compatible engines (vLLM, llama.cpp, SGLang, TGI, another gateway), "
        "balanced in the first tier with our CB servers unless their 'tier' says otherwise",
    )
    openai_jumper_configs: list[OpenAIJumperConfig] = Field(
        default_factory=list,
        description="OpenAI-compatible accounts used as a fallback (the fallback tier)",
    )

    @property
    def enabled_jumpers(self) -> list[OpenAIJumperConfig]:
        """The jumper entries that carry a real key."""
        return [jumper for jumper in self.openai_jumper_configs if jumper.is_enabled]


class _ProbeFailed(Exception):
    """A heartbeat that found the engine unreachable, or answering something else than 200."""


@dataclass(eq=False)
class OpenAICompatibleUpstream(Backend):
    """One OpenAI-compatible engine or account (``config.tier`` says which)."""

    kind = "openai_compatible"
    noun = "OpenAI-compatible engine"
    section = OpenAICompatibleSection

    config: OpenAICompatibleConfig = field(kw_only=True)
    #: Position among the fallback-tier entries (names an account without its key).
    index: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        listed = list(dict.fromkeys([*self.config.models, *self.config.model_map]))
        self.health.model_ids = listed
        if self.is_fallback:  # an account is up unless its key rests (an open circuit)
            self.health.is_healthy = True
            self.health.reported_status = "ok"

    @classmethod
    def from_config(cls, config: OpenAICompatibleSection) -> list[Backend]:
        """Engines first, then the jumper accounts with a real key. Accounts are numbered by
        position: jumper entries by theirs in ``openai_jumper_configs``, fallback-tier engine
        entries after them."""
        jumpers = config.openai_jumper_configs
        backends: list[Backend] = []
        num_engine_accounts = 0
        for entry in config.openai_compatible_server_urls:
            index = len(jumpers) + num_engine_accounts
            backends.append(cls(url=entry.url, config=entry, index=index))
            num_engine_accounts += entry.tier == "fallback"
        for index, jumper in enumerate(jumpers):
            if jumper.is_enabled:  # placeholder keys are skipped, never sent
                entry = jumper.upstream_config()
                backends.append(cls(url=entry.url, config=entry, index=index))
        return backends

    @classmethod
    def listed_urls(cls, config: OpenAICompatibleSection) -> list[str]:
        """The engines' URLs (accounts may share a base URL: each key is one backend)."""
        return [entry.url for entry in config.openai_compatible_server_urls]

    @property
    def tier(self) -> Tier:  # type: ignore[override]
        """The entry's tier."""
        return self.config.tier

    @property
    def uses_proxy(self) -> bool:  # type: ignore[override]
        """Accounts are the outside world: their calls honour HTTP(S)_PROXY."""
        return self.is_fallback

    @property
    def name(self) -> str:
        """The URL; an account: ``openai[<index>]@<base url>`` (never its key)."""
        return f"openai[{self.index}]@{self.url}" if self.is_fallback else self.url

    @property
    def identity(self) -> tuple[object, ...]:
        """An account is its key; an engine its address."""
        if self.is_fallback:
            return (self.kind, self.url, self.config.key, self.config.org_id)
        return (self.kind, self.url)

    def adopt_settings(self, fresh: Backend) -> None:
        """The same upstream from a reloaded config: take its entry, position and models
        (an engine keeps the models it learnt when its entry lists none)."""
        assert isinstance(fresh, OpenAICompatibleUpstream)
        self.config, self.index = fresh.config, fresh.index
        self.health.name = self.name
        if fresh.health.model_ids or self.is_fallback:
            self.health.model_ids = list(fresh.health.model_ids)

    def serves(self, model: str) -> bool:
        """An account listing no model serves any; otherwise the listed (or learnt) ones."""
        model_ids = self.health.model_ids
        return (self.is_fallback and not model_ids) or model in model_ids

    def plan(self, request: GatewayRequest) -> Plan:
        """OpenAI requests as sent; native ones through the OpenAI API when it can say the
        same; nothing else."""
        noun = "OpenAI-compatible upstreams" if self.is_fallback else "OpenAI-compatible engines"
        if request.endpoint == Endpoint.RELAYED:
            if request.path in self.config.relayed_paths:
                return Plan(path=request.path)
            return Plan(refusal=f"{self.url} does not relay {request.path} (relayed_paths)")
        if request.endpoint.is_openai:
            return AS_SENT
        if request.endpoint != Endpoint.GENERATE:
            return Plan(refusal=f"{noun} do not answer {request.endpoint}")
        if request.native is None:
            return without_native_form(request, self.noun)
        unsupported = upstream_unsupported_fields(request.native)
        if unsupported:
            return Plan(refusal=f"{noun} cannot honour {', '.join(unsupported)}")
        model = self.upstream_model(request.model)
        if model is None and not self.is_fallback:
            # Triton's "ensemble" alias names no model; vLLM insists on one: its first model.
            model = next(iter(self.health.model_ids), None)
        return Plan(translation=NativeToOpenAI(request.native, model, request.model))

    def upstream_model(self, model: str | None) -> str | None:
        """The upstream's name for ``model`` (``model_map``), else the same name."""
        if model is None:
            return None
        return self.config.model_map.get(model, model)

    def url_for(self, path: str) -> str:
        """``/v1/...`` -> the API base without ``/v1``; other paths (health, metrics) -> the
        root URL."""
        if path.startswith("/v1/"):
            return self.config.api_base + path.removeprefix("/v1")
        return self.url + path

    def request_headers(self) -> dict[str, str]:
        """The key (and organization) of this entry."""
        headers = {"authorization": f"Bearer {self.config.key}"} if self.config.key else {}
        if self.config.org_id:
            headers["openai-organization"] = self.config.org_id
        return headers

    @property
    def secret(self) -> str:
        """The entry's key."""
        return self.config.key

    def rest(self, seconds: float) -> None:
        """Keep the key out of rotation for ``seconds``."""
        self.health.breaker.open_for(seconds)

    def on_unreachable(self, error: str, cooldown_seconds: float) -> None:
        """An account has no heartbeat to tell when it is back: it rests for the cooldown."""
        if self.is_fallback:
            self.rest(cooldown_seconds)
        else:
            super().on_unreachable(error, cooldown_seconds)

    def on_overloaded(self, retry_after_seconds: float | None, cooldown_seconds: float) -> None:
        """A rate-limited account rests for the upstream's Retry-After (else the cooldown)."""
        if self.is_fallback:
            self.rest(retry_after_seconds or cooldown_seconds)

    def refuses_credentials(self, status: int) -> bool:
        """401/403 on an account: the key is refused; it rests long (a reload replaces it)."""
        if not self.is_fallback or status not in REFUSED_KEY_STATUSES:
            return False
        self.rest(REFUSED_KEY_COOLDOWN_SECONDS)
        return True

    async def probe(self, client: httpx.AsyncClient, timeout_seconds: float) -> None:
        """Heartbeat: the health path (else ``/v1/models``), the model list and the metrics,
        concurrently; never raises for network trouble (it marks the engine down). Accounts
        get none (it would spend quota): their health is the key's circuit."""
        if self.is_fallback:
            self.health.is_healthy = True
            return
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
            self.health.record_failed_heartbeat(str(health))
            return
        model_ids, max_model_len = self._models_of(listed)
        if not model_ids and not self.config.models:
            # Alive, but nothing says which models: not routable until /v1/models answers.
            self.health.record_health("loading", [], None, LoadReport())
            return
        load = metrics if isinstance(metrics, LoadReport) else LoadReport()
        served = list(self.config.models) or model_ids
        self.health.record_health("ok", served, max_model_len, load)

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
