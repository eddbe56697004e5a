"""The gateway's JSON config (``configs/client_config.json``), validated at start-up.

The keys of the seed template are kept (``continuous_batching_server_urls``,
``static_batching_server_urls``, ``openai_jumper_configs``, ``heart_beat_interval_seconds``);
the rest are what an operator needs to tune (balancing policy, timeouts, body size limit).
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from client.config.engines import OpenAICompatibleServerConfig
from client.config.schema_common import (  # noqa: F401 (re-exported: imported from here)
    EnvSecret,
    check_base_url,
    is_placeholder_key,
    secret_from_env,
)
from utils.connection_limits import ConnectionLimits

#: Balancing policies the config may name (one class each in ``client.balancing.policies``).
PolicyName = Literal["least_outstanding", "round_robin", "power_of_two", "affinity"]

# The launcher's rule for app names (launcher.deployment.NAME_PATTERN).
_APP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_app_name(entry: str) -> bool:
    """True for a deployment app name (``cb_server``) rather than a URL in a server list."""
    return "://" not in entry and bool(_APP_NAME.match(entry))


def check_server_lists(cb: list[str], sb: list[str], triton: list[str]) -> None:
    """Refuse a server listed twice, in one list or across the lists (``ValueError``)."""
    for urls in (cb, sb):
        if len(set(urls)) != len(urls):
            raise ValueError("a server URL is listed more than once")
    both = set(cb) & set(sb)
    if both:
        raise ValueError(
            f"{sorted(both)} listed as both a continuous- and a static-batching server"
        )
    if len(set(triton)) != len(triton):
        raise ValueError("a Triton or OpenAI-compatible server URL is listed more than once")
    if (set(cb) | set(sb)) & set(triton):
        raise ValueError(
            f"{sorted((set(cb) | set(sb)) & set(triton))} listed as a Triton or "
            "OpenAI-compatible server too"
        )


class OpenAIJumperConfig(BaseModel):
    """One OpenAI-compatible upstream account (an "OpenAI jumper").

    ``api_key`` is a ``SecretStr``: its ``repr`` and ``str`` are masked, so it never reaches a
    log line by accident. Placeholder keys disable the entry (see :attr:`is_enabled`).
    ``{"env": "NAME"}`` instead names an environment variable holding the key (on Kubernetes,
    one filled from a Secret), so that the key never sits in the config file; an unset variable
    stops start-up with an error naming it.
    """

    model_config = ConfigDict(extra="forbid")

    api_key: EnvSecret
    org_id: str | None = None
    base_url: str = "https://api.openai.com/v1"
    models: list[str] = Field(
        default_factory=list, description="model ids this upstream serves (empty: any)"
    )
    model_map: dict[str, str] = Field(
        default_factory=dict, description="gateway model id -> upstream model id"
    )

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str) -> str:
        return check_base_url(value)

    @property
    def is_enabled(self) -> bool:
        """False when the key is a template placeholder rather than a real key."""
        return not is_placeholder_key(self.api_key.get_secret_value())


class TritonServerConfig(BaseModel):
    """One Triton Inference Server (e.g. with TensorRT-LLM) behind the gateway."""

    model_config = ConfigDict(extra="forbid")

    url: str
    models: dict[str, str] = Field(
        min_length=1,
        description="gateway model id -> Triton model name (TensorRT-LLM: usually 'ensemble')",
    )
    default_max_tokens: int = Field(
        default=256, ge=1, description="max_tokens sent when a request sets none (Triton needs one)"
    )
    chat_template_from: str | None = Field(
        default=None,
        description="a Hugging Face tokenizer folder whose chat template renders chat requests "
        "into text for this server (without it, chats never go there)",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return check_base_url(value)


class ServerDNSConfig(BaseModel):
    """Servers of one kind found through DNS: every address ``name`` resolves to is a server.

    A Kubernetes headless Service answers one A record per ready pod, so the gateway follows
    the pods without a config change. The name is resolved again at every heartbeat.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="DNS name to resolve (all its A/AAAA records)")
    port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"


class TritonServerDNSConfig(ServerDNSConfig):
    """Triton servers found through DNS; every address gets the same model names."""

    models: dict[str, str] = Field(min_length=1)
    default_max_tokens: int = Field(default=256, ge=1)
    chat_template_from: str | None = None

    def server_config(self, url: str) -> TritonServerConfig:
        """The entry of one discovered Triton server at ``url``."""
        fields = self.model_dump(exclude={"name", "port", "scheme"})
        return TritonServerConfig(url=url, **fields)


class ClientConfig(ConnectionLimits):
    """The gateway's config file; unknown keys are refused so that typos surface at start-up.

    The HTTP connection limits (``header_timeout_seconds`` ...) are its keys too. Every key can
    be overridden from the environment: ``LLM_SUITE_GATEWAY__KEY`` (nesting with ``__``, see
    ``utils.env_overrides``).
    """

    model_config = ConfigDict(extra="forbid")
    env_prefix: ClassVar[str] = "LLM_SUITE_GATEWAY"

    continuous_batching_server_urls: list[str] = Field(default_factory=list)
    static_batching_server_urls: list[str] = Field(default_factory=list)
    embedding_server_urls: list[str] = Field(
        default_factory=list,
        description="embedding servers (embedding_server_app), URLs or deployment app names",
    )
    triton_server_urls: list[TritonServerConfig] = Field(default_factory=list)
    openai_compatible_server_urls: list[OpenAICompatibleServerConfig] = Field(
        default_factory=list,
        description="OpenAI-compatible engines (vLLM, llama.cpp, SGLang, TGI, another gateway) "
        "balanced in the first tier with our CB servers",
    )
    triton_model_aliases: dict[str, str] = Field(
        default_factory=lambda: {"ensemble": ""},
        description="Triton API on the gateway: model names clients use -> gateway model id "
        "('' = any model); a Triton + TensorRT-LLM client calls its model 'ensemble'",
    )
    continuous_batching_server_dns: ServerDNSConfig | None = None
    static_batching_server_dns: ServerDNSConfig | None = None
    triton_server_dns: TritonServerDNSConfig | None = None
    openai_jumper_configs: list[OpenAIJumperConfig] = Field(default_factory=list)
    heart_beat_interval_seconds: float = Field(default=10.0, gt=0)
    num_failures_to_mark_down: int = Field(
        default=2, ge=1, description="consecutive failed heartbeats before a server is down"
    )
    balancing_policy: PolicyName = "least_outstanding"
    affinity_max_imbalance: int = Field(
        default=8,
        ge=0,
        description="affinity: leave the preferred server when it has this many more "
        "outstanding requests than the least loaded one",
    )
    max_attempts: int = Field(
        default=3, ge=1, description="servers tried per request before the caller gets an error"
    )
    retry_backoff_seconds: float = Field(
        default=0.05, ge=0, description="base of the jittered exponential backoff between tries"
    )
    circuit_breaker_failures: int = Field(
        default=3, ge=1, description="consecutive request failures that open a server's circuit"
    )
    circuit_breaker_cooldown_seconds: float = Field(
        default=15.0, gt=0, description="how long an open circuit keeps traffic away"
    )
    jumper_cooldown_seconds: float = Field(
        default=30.0,
        gt=0,
        description="rest for an upstream key after a 429/5xx without Retry-After",
    )
    api_keys: list[EnvSecret] = Field(
        default_factory=list,
        description="when non-empty, callers must send 'Authorization: Bearer <one of these>'; "
        'each entry a key or {"env": "NAME"} (read from that environment variable)',
    )
    config_watch_interval_seconds: float = Field(
        default=2.0, ge=0, description="how often the config file is checked for changes (0: off)"
    )
    request_timeout_seconds: float = Field(
        default=600.0, gt=0, description="read timeout: longest silence from a server"
    )
    connect_timeout_seconds: float = Field(default=5.0, gt=0)
    health_timeout_seconds: float = Field(default=3.0, gt=0)
    max_request_bytes: int = Field(default=1_000_000, gt=0)
    deployment_file: str | None = Field(
        default=None,
        description="the deployment file whose app names the server lists may use instead of "
        "URLs (default: $LLM_SUITE_DEPLOYMENT_FILE, set by the launcher, else deployment.json "
        "beside this file)",
    )
    shared_state_url: str | None = Field(
        default=None,
        description="redis://host:port/db shared by gateway replicas: circuit openings and "
        "jumper key rests apply on all of them (unset: each replica keeps its own)",
    )

    @field_validator("shared_state_url")
    @classmethod
    def _check_shared_state_url(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"{value!r} must start with redis://, rediss:// or unix://")
        return value

    @field_validator(
        "continuous_batching_server_urls", "static_batching_server_urls", "embedding_server_urls"
    )
    @classmethod
    def _check_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not is_app_name(url):
                check_base_url(url)
        return value

    @model_validator(mode="after")
    def _check_lists(self) -> ClientConfig:
        check_server_lists(
            self.continuous_batching_server_urls,
            self.static_batching_server_urls,
            [server.url for server in self.triton_server_urls]
            + [server.url for server in self.openai_compatible_server_urls]
            + self.embedding_server_urls,
        )
        return self

    @property
    def dns_entries(self) -> list[ServerDNSConfig]:
        """The DNS names this config discovers servers from (CB, SB, Triton)."""
        entries = (
            self.continuous_batching_server_dns,
            self.static_batching_server_dns,
            self.triton_server_dns,
        )
        return [entry for entry in entries if entry is not None]

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        for key in value:
            if is_placeholder_key(key.get_secret_value()):
                # Never echo the value: it may be a real key that merely looks odd.
                raise ValueError("an entry of api_keys is empty or a template placeholder")
        return value

    @property
    def enabled_jumpers(self) -> list[OpenAIJumperConfig]:
        """The jumper entries that carry a real key."""
        return [jumper for jumper in self.openai_jumper_configs if jumper.is_enabled]
