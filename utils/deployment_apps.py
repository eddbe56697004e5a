"""The addresses of a deployment file's apps, for configs that name an app instead of a URL.

Only what an address needs is read (each app's ``name``, ``host`` and ``port``); the launcher
validates the whole file (``launcher.deployment``). This lives in ``utils`` so that the gateway
can read it without depending on the launcher.
"""

from __future__ import annotations

import os

from utils.config import ConfigError, read_config_data

#: Overrides of the deployment's keys from the environment (``utils.env_overrides``); read
#: here as by the launcher, so that a port moved by a variable moves for both.
DEPLOYMENT_ENV_PREFIX = "LLM_SUITE_DEPLOYMENT"
#: Set by the launcher for every app it starts from a deployment file (the file's path).
DEPLOYMENT_FILE_ENV = "LLM_SUITE_DEPLOYMENT_FILE"


def base_url(host: str, port: int) -> str:
    """URL to reach an app bound to ``host``: wildcard binds are reached over loopback."""
    connect = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in connect:
        connect = f"[{connect}]"
    return f"http://{connect}:{port}"


def app_urls(path: str | os.PathLike[str]) -> dict[str, str]:
    """``{app name: base URL}`` of every app in the deployment file at ``path``.

    Raises ``ValueError`` naming the file when it cannot be read or has no usable app list.
    """
    try:
        data, _ = read_config_data(path, DEPLOYMENT_ENV_PREFIX)
    except ConfigError as exc:
        raise ValueError(f"deployment file {exc}") from None
    apps = data.get("apps") if isinstance(data, dict) else None
    if not isinstance(apps, list):
        raise ValueError(f"deployment file {path} has no 'apps' list")
    urls = {}
    for app in apps:
        if isinstance(app, dict) and isinstance(app.get("name"), str) and "port" in app:
            urls[app["name"]] = base_url(str(app.get("host", "127.0.0.1")), int(app["port"]))
    return urls
