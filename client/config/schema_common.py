"""Pieces the gateway config's sections share: secrets from the environment, server addresses
(or deployment app names), DNS entries, placeholder keys. Kept apart so that each backend
kind's section (``client.backends.kinds``) and ``client.config.schema`` import them without
importing each other."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, SecretStr

# Template values such as the seed's "YOUR_OPENAI_KEY" must never be sent as a key.
_PLACEHOLDER_KEY = re.compile(
    r"^(|your[_\- ].*|<.*>|\$\{.*\}|change[_\-]?me|x{3,}|\.{3}|sk-\.{3}|none|null)$",
    re.IGNORECASE,
)


def secret_from_env(value: Any) -> Any:
    """``{"env": "NAME"}`` -> the value of ``$NAME``, so that keys need not live in the file.

    A variable that is not set is an error naming it (never its value: there is none).
    """
    if isinstance(value, dict) and set(value) == {"env"}:
        name = value["env"]
        if not isinstance(name, str) or not name:
            raise ValueError('{"env": NAME} needs the name of an environment variable')
        if name not in os.environ:
            raise ValueError(f"environment variable {name} is not set")
        return os.environ[name]
    return value


#: A secret given in the file or, as ``{"env": "NAME"}``, by an environment variable.
EnvSecret = Annotated[SecretStr, BeforeValidator(secret_from_env)]


def check_base_url(url: str) -> str:
    """Validate a server address: http(s), a host, no trailing slash, no query or fragment."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"{url!r} has no host")
    if url.endswith("/"):
        raise ValueError(f"{url!r} must not end with '/' (write {url.rstrip('/')!r})")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r} must not have a query string or fragment")
    try:
        _ = parts.port  # raises on a non-numeric or out-of-range port
    except ValueError as exc:
        raise ValueError(f"{url!r} has an invalid port: {exc}") from None
    return url


#: A server's base URL, checked by :func:`check_base_url`.
BaseURL = Annotated[str, AfterValidator(check_base_url)]


# The launcher's rule for app names (launcher.deployment.NAME_PATTERN).
_APP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_app_name(entry: str) -> bool:
    """True for a deployment app name (``cb_server``) rather than a URL in a server list."""
    return "://" not in entry and bool(_APP_NAME.match(entry))


def check_server_address(entry: str) -> str:
    """A server list entry: a deployment app name, or a valid server URL."""
    return entry if is_app_name(entry) else check_base_url(entry)


#: One entry of a server URL list: a URL, or the name of an app of the deployment.
ServerAddress = Annotated[str, AfterValidator(check_server_address)]


class ServerDNSConfig(BaseModel):
    """Servers of one kind found through DNS: every address ``name`` resolves to is a server.

    A Kubernetes headless Service answers one A record per ready pod, so the gateway follows
    the pods without a config change. The name is resolved again at every heartbeat.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="DNS name to resolve (all its A/AAAA records)")
    port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"


def is_placeholder_key(key: str) -> bool:
    """True for empty keys and template values like ``YOUR_OPENAI_KEY`` (treated as disabled)."""
    return bool(_PLACEHOLDER_KEY.match(key.strip()))
