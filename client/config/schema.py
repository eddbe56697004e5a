"""The gateway's JSON config (``configs/client_config.json``), validated at start-up.

The keys of the seed template are kept (``continuous_batching_server_urls``,
``static_batching_server_urls``, ``openai_jumper_configs``, ``heart_beat_interval_seconds``);
the rest are what an operator needs to tune (balancing policy, timeouts, body size limit).
"""

from __future__ import annotations

from typing import ClassVar
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from client.backends.backend import Backend
from client.balancing.policies import PolicyName
from client.config.kinds import KINDS
from client.config.schema_common import EnvSecret, ServerDNSConfig, is_placeholder_key
from utils.connection_limits import ConnectionLimits


def check_listed_once(config: ClientConfig) -> None:
    """Refuse a server listed twice, in one list or across kinds (``ValueError``)."""
    seen: dict[str, str] = {}
    for kind in KINDS:
        noun = f"a {kind.noun}"
        for url in kind.listed_urls(config):
            if url in seen:
                where = "once" if seen[url] == noun else f"both as {seen[url]} and as {noun}"
                raise ValueError(f"{url!r} is listed more than once ({where})")
            seen[url] = noun


#: Every kind's config keys: the gateway config is made of them (see ``client.config.kinds``).
_SECTIONS = tuple(kind.section for kind in KINDS)


class ClientConfig(ConnectionLimits, *_SECTIONS):
    """The gateway's config file; unknown keys are refused so that typos surface at start-up.

    Each backend kind's keys come from its section (``client.config.kinds``); the HTTP
    connection limits (``header_timeout_seconds`` ...) are its keys too. Every key can
    be overridden from the environment: ``LLM_SUITE_GATEWAY__KEY`` (nesting with ``__``, see
    ``utils.env_overrides``).
    """

    model_config = ConfigDict(extra="forbid")
    env_prefix: ClassVar[str] = "LLM_SUITE_GATEWAY"

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
    max_stream_resumes: int = Field(
        default=2,
        ge=0,
        description="times a stream from one of our servers that dies mid-answer is resumed on "
        "another (0: never); never after a second server died within a second of taking it",
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

    @model_validator(mode="after")
    def _check_lists(self) -> ClientConfig:
        check_listed_once(self)
        return self

    @property
    def dns_entries(self) -> list[tuple[type[Backend], ServerDNSConfig]]:
        """The DNS names this config discovers servers from, with their kinds."""
        entries = [(kind, kind.dns_entry(self)) for kind in KINDS]
        return [(kind, entry) for kind, entry in entries if entry is not None]

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        for key in value:
            if is_placeholder_key(key.get_secret_value()):
                # Never echo the value: it may be a real key that merely looks odd.
                raise ValueError("an entry of api_keys is empty or a template placeholder")
        return value
