"""Config entries of OpenAI-compatible engines served as first-tier servers of the gateway
(``openai_compatible_server_urls``): ``vllm serve``, llama.cpp's ``llama-server``, SGLang, TGI's
OpenAI API, or another of our gateways.

Kept apart from ``client.config.schema`` so that each engine kind's settings live in one small
module; the gateway config imports the entry type from here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from client.config.schema_common import EnvSecret, check_base_url


class OpenAICompatibleServerConfig(BaseModel):
    """One OpenAI-compatible engine behind the gateway, balanced like our own CB servers.

    Unlike an OpenAI jumper (a fallback account with API-key semantics), an engine is a server:
    it is heart-beaten, its load is read from its Prometheus ``/metrics`` when it exports vLLM's
    queue gauges, and it shares the first routing tier with our CB servers.
    """

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        description="the engine's root address, e.g. http://10.0.0.5:8000 (a trailing /v1 is "
        "dropped: the gateway appends the API paths)"
    )
    models: list[str] = Field(
        default_factory=list,
        description="model ids it serves (empty: learnt from its GET /v1/models)",
    )
    api_key: EnvSecret | None = Field(
        default=None,
        description='bearer key the engine wants (e.g. vllm serve --api-key), or {"env": NAME}',
    )
    health_path: str | None = Field(
        default=None,
        description="GET path whose 200 means alive (vLLM and TGI: /health; default: /v1/models)",
    )

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
