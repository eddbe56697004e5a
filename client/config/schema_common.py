"""Pieces every gateway config entry shares: secrets from the environment, server addresses,
placeholder keys (kept apart so that entry modules such as ``client.config.engines`` and
``client.config.schema`` both import them without importing each other)."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import BeforeValidator, SecretStr

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


def is_placeholder_key(key: str) -> bool:
    """True for empty keys and template values like ``YOUR_OPENAI_KEY`` (treated as disabled)."""
    return bool(_PLACEHOLDER_KEY.match(key.strip()))
