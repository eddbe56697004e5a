"""OpenAI-compatible upstreams ("OpenAI jumpers"): one backend per configured API key.

The gateway falls back to them when no local server can take a request, or sends a request
there when the caller asks for it (``X-LLM-Route: openai``). Among the keys able to serve a
model the least recently used one goes first; a key that answers 429 or 5xx rests (its circuit
opens) for the upstream's Retry-After or ``jumper_cooldown_seconds``, and one that is refused
(401/403) rests much longer. Keys never appear in logs, errors, metrics or the status table:
each jumper is named by its position in the config and its base URL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from client.backends.base import AS_SENT, Backend, Plan
from client.backends.native_to_openai import NativeToOpenAI, upstream_unsupported_fields
from client.backends.translation import SecretScrubber, StreamTranslator
from client.config.schema import OpenAIJumperConfig
from client.gateway_request import GatewayRequest

#: The OpenAI API paths a jumper forwards (our ``/v1/...`` path minus the ``/v1`` that the
#: jumper's base URL already ends with).
JUMPER_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
#: Paths a jumper answers through translation (``client.backends.native_to_openai``).
TRANSLATED_PATHS = ("/generate",)

#: How long a key rests after the upstream refused it (401/403): a wrong or revoked key will
#: not heal by itself, but a config reload replaces it without waiting.
REFUSED_KEY_COOLDOWN_SECONDS = 600.0
#: Upstream statuses that mean the key is not accepted.
REFUSED_KEY_STATUSES = (401, 403)


@dataclass(eq=False)
class OpenAIJumper(Backend):
    """One API key at one OpenAI-compatible base URL."""

    config: OpenAIJumperConfig = field(kw_only=True)
    index: int = field(default=0, kw_only=True)
    #: Monotonic time of the last request sent with this key (least recently used goes first).
    last_used_at: float = 0.0

    def __post_init__(self) -> None:
        # A jumper has no heartbeat: it is up unless its key rests (an open circuit).
        self.is_healthy = True
        self.reported_status = "ok"
        self.model_ids = list(dict.fromkeys([*self.config.models, *self.config.model_map]))

    @classmethod
    def from_config(cls, config: OpenAIJumperConfig, index: int) -> OpenAIJumper:
        """The jumper for the ``index``-th entry of ``openai_jumper_configs``."""
        return cls(url=config.base_url, kind="openai", config=config, index=index)

    @property
    def name(self) -> str:
        """``openai[<index>]@<base url>``: identifies the entry without showing its key."""
        return f"openai[{self.index}]@{self.url}"

    @property
    def identity(self) -> tuple[object, ...]:
        """What makes two entries the same key (kept across config reloads)."""
        return (self.kind, self.url, self.config.api_key.get_secret_value(), self.config.org_id)

    def adopt_settings(self, fresh: Backend) -> None:
        """Same key: keep its rest and usage, take the entry's new position and models."""
        assert isinstance(fresh, OpenAIJumper)
        self.config, self.index, self.model_ids = fresh.config, fresh.index, fresh.model_ids

    def serves(self, model: str) -> bool:
        """True when the entry lists ``model`` (in ``models`` or ``model_map``), or lists none."""
        return not self.model_ids or model in self.model_ids

    def plan(self, request: GatewayRequest) -> Plan:
        """The OpenAI endpoints go as they are; a native request goes through the OpenAI API
        unless it uses what that API lacks; nothing else goes upstream."""
        if request.endpoint in JUMPER_PATHS:
            return AS_SENT
        if request.endpoint not in TRANSLATED_PATHS or request.native is None:
            return Plan(refusal=f"OpenAI-compatible upstreams do not answer {request.endpoint}")
        unsupported = upstream_unsupported_fields(request.native)
        if unsupported:
            return Plan(
                refusal=f"OpenAI-compatible upstreams cannot honour {', '.join(unsupported)}"
            )
        upstream_model = self.upstream_model(request.model)
        return Plan(translation=NativeToOpenAI(request.native, upstream_model, request.model))

    def upstream_model(self, model: str | None) -> str | None:
        """The upstream's name for ``model`` (``model_map``), else the same name."""
        if model is None:
            return None
        return self.config.model_map.get(model, model)

    def url_for(self, path: str) -> str:
        """``/v1/chat/completions`` -> ``<base_url>/chat/completions``."""
        return self.url + path.removeprefix("/v1")

    def request_headers(self) -> dict[str, str]:
        """The key (and organization) of this entry."""
        headers = {"authorization": f"Bearer {self.config.api_key.get_secret_value()}"}
        if self.config.org_id:
            headers["openai-organization"] = self.config.org_id
        return headers

    def on_request_sent(self) -> None:
        """Remember when the key was last used (least recently used goes first)."""
        self.last_used_at = time.monotonic()

    def rest(self, seconds: float) -> None:
        """Keep the key out of rotation for ``seconds``."""
        self.breaker.open_for(seconds)

    def on_unreachable(self, error: str, cooldown_seconds: float) -> None:
        """No heartbeat tells when an upstream is back: the key rests for the cooldown."""
        self.rest(cooldown_seconds)

    def on_overloaded(self, retry_after_seconds: float | None, cooldown_seconds: float) -> None:
        """A rate-limited key rests for the upstream's Retry-After (else the cooldown)."""
        self.rest(retry_after_seconds or cooldown_seconds)

    def refuses_credentials(self, status: int) -> bool:
        """401/403: the key is refused; it rests long (a reload replaces it sooner)."""
        if status not in REFUSED_KEY_STATUSES:
            return False
        self.rest(REFUSED_KEY_COOLDOWN_SECONDS)
        return True

    async def probe(self, client: httpx.AsyncClient, timeout_seconds: float) -> None:
        """No heartbeat upstream (it would spend quota); health is the key's circuit."""
        self.is_healthy = True

    def stream_filter(self, translator: StreamTranslator | None) -> StreamTranslator | None:
        """Every streamed byte is scrubbed of this entry's key (error events may quote it)."""
        key = self.config.api_key.get_secret_value()
        return SecretScrubber(key, translator) if key else translator

    def scrub(self, text: str) -> str:
        """``text`` with this entry's key masked (upstream errors sometimes echo the key)."""
        key = self.config.api_key.get_secret_value()
        return text.replace(key, "***") if key else text


def make_jumpers(configs: list[OpenAIJumperConfig]) -> list[OpenAIJumper]:
    """One jumper per enabled entry (placeholder keys are skipped), numbered by config position."""
    return [
        OpenAIJumper.from_config(config, index)
        for index, config in enumerate(configs)
        if config.is_enabled
    ]
