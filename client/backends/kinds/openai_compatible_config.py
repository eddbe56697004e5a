"""Config entries of OpenAI-compatible upstreams, the one kind behind two config keys:

- ``openai_compatible_server_urls``: engines (``vllm serve``, llama.cpp's ``llama-server``,
  SGLang, TGI's OpenAI API, another of our gateways), by default in the first tier;
- ``openai_jumper_configs``: metered accounts ("OpenAI jumpers", the seed's key), always in the
  fallback tier.

Both become an :class:`OpenAICompatibleConfig`; its ``tier`` decides how the backend behaves.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from client.config.schema_common import BaseURL, EnvSecret, check_base_url, is_placeholder_key
from client.endpoints import Endpoint

#: The gateway's own POST paths: a relayed path is none of them.
_GATEWAY_PATHS = frozenset(endpoint.value for endpoint in Endpoint)

#: The tiers an OpenAI-compatible upstream may be put in (see ``client.backends.backend``).
UpstreamTier = Literal["first", "second", "fallback"]


class OpenAICompatibleConfig(BaseModel):
    """One OpenAI-compatible upstream: an entry of ``openai_compatible_server_urls``.

    In the ``first`` (default) or ``second`` tier it is a server: heart-beaten (its
    ``health_path``, else ``GET /v1/models``), its models learnt from ``/v1/models`` unless
    listed, its load read from vLLM's queue gauges on ``/metrics``. In the ``fallback`` tier it
    is a metered account, as an OpenAI jumper: no heartbeat (it would spend quota), the least
    recently used key goes first, and a key that answers 429/5xx or is refused rests.
    """

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        description="the upstream's root address, e.g. http://10.0.0.5:8000 (a trailing /v1 is "
        "dropped: the gateway appends the API paths)"
    )
    tier: UpstreamTier = Field(
        default="first",
        description="first: balanced with our CB servers; second: with our SB servers; "
        "fallback: a metered account used only when no server can take a request",
    )
    models: list[str] = Field(
        default_factory=list,
        description="model ids it serves (empty: learnt from its GET /v1/models; in the "
        "fallback tier: any)",
    )
    model_map: dict[str, str] = Field(
        default_factory=dict, description="gateway model id -> upstream model id"
    )
    api_key: EnvSecret | None = Field(
        default=None,
        description='bearer key the upstream wants (e.g. vllm serve --api-key), or {"env": NAME}',
    )
    org_id: str | None = Field(default=None, description="sent as OpenAI-Organization")
    health_path: str | None = Field(
        default=None,
        description="GET path whose 200 means alive (vLLM and TGI: /health; default: /v1/models)",
    )
    relayed_paths: list[str] = Field(
        default_factory=list,
        description="POST paths of this upstream's own the gateway relays as they come (JSON "
        "bodies routed by their model), e.g. vLLM's /v1/rerank, /v1/score, /pooling",
    )
    #: The OpenAI API's base (``/v1`` paths go there without their ``/v1``); the root URL's
    #: ``/v1`` unless the entry came from ``openai_jumper_configs`` with a base URL of its own.
    api_base: str = Field(default="", exclude=True, repr=False)

    @field_validator("url", mode="before")
    @classmethod
    def _check_url(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.rstrip("/").removesuffix("/v1")
            return check_base_url(value)
        return value

    @field_validator("health_path")
    @classmethod
    def _check_health_path(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"{value!r} must start with '/'")
        return value

    @field_validator("relayed_paths")
    @classmethod
    def _check_relayed_paths(cls, value: list[str]) -> list[str]:
        for path in value:
            if not path.startswith("/") or path in _GATEWAY_PATHS:
                raise ValueError(
                    f"{path!r} must start with '/' and not be one of the gateway's own paths"
                )
        return value

    def model_post_init(self, context: object) -> None:
        """Default the API base to the root URL's ``/v1``."""
        if not self.api_base:
            self.api_base = self.url + "/v1"

    @property
    def key(self) -> str:
        """The bearer key ("" when none)."""
        return "" if self.api_key is None else self.api_key.get_secret_value()


class OpenAIJumperConfig(BaseModel):
    """One OpenAI-compatible upstream account (an "OpenAI jumper"), in the fallback tier.

    ``api_key`` is a ``SecretStr``: its ``repr`` and ``str`` are masked, so it never reaches a
    log line by accident. Placeholder keys disable the entry (see :attr:`is_enabled`).
    ``{"env": "NAME"}`` instead names an environment variable holding the key (on Kubernetes,
    one filled from a Secret), so that the key never sits in the config file; an unset variable
    stops start-up with an error naming it.
    """

    model_config = ConfigDict(extra="forbid")

    api_key: EnvSecret
    org_id: str | None = None
    base_url: BaseURL = "https://api.openai.com/v1"
    models: list[str] = Field(
        default_factory=list, description="model ids this upstream serves (empty: any)"
    )
    model_map: dict[str, str] = Field(
        default_factory=dict, description="gateway model id -> upstream model id"
    )

    @property
    def is_enabled(self) -> bool:
        """False when the key is a template placeholder rather than a real key."""
        return not is_placeholder_key(self.api_key.get_secret_value())

    def upstream_config(self) -> OpenAICompatibleConfig:
        """The same account as an OpenAI-compatible upstream in the fallback tier (its base
        URL shown as is, its API paths appended without ``/v1``)."""
        # Constructed, not validated: the base URL keeps its /v1 (it is the API base here).
        return OpenAICompatibleConfig.model_construct(
            url=self.base_url,
            tier="fallback",
            models=list(self.models),
            model_map=dict(self.model_map),
            api_key=self.api_key,
            org_id=self.org_id,
            health_path=None,
            api_base=self.base_url,
        )
