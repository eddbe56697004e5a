"""Reading the gateway's config file: validation, then app names resolved to URLs.

A server list may name an app of the deployment (``"cb_server"``) instead of its URL, so that a
port lives in one file only: the deployment's. The deployment file is the config's
``deployment_file`` (relative to the config's folder), else ``$LLM_SUITE_DEPLOYMENT_FILE`` (the
launcher sets it for the apps it starts), else ``deployment.json`` beside the config.
"""

from __future__ import annotations

import os
from pathlib import Path

from client.config.kinds import KINDS
from client.config.schema import ClientConfig, check_listed_once
from client.config.schema_common import is_app_name
from utils.config import ConfigError, load_config, resolve_path
from utils.deployment_apps import DEPLOYMENT_FILE_ENV, app_urls

#: The config keys whose entries may name deployment apps, kind by kind.
_LISTS = tuple(key for kind in KINDS for key in kind.app_name_keys())


def deployment_file_for(config: ClientConfig, config_path: str | Path) -> Path:
    """The deployment file whose app names ``config`` may use (see the module's docstring)."""
    if config.deployment_file:
        return Path(resolve_path(config_path, config.deployment_file))
    if os.environ.get(DEPLOYMENT_FILE_ENV):
        return Path(os.environ[DEPLOYMENT_FILE_ENV])
    return Path(config_path).resolve().parent / "deployment.json"


def load_client_config(path: str | Path, deployment_file: str | Path | None = None) -> ClientConfig:
    """Read and validate the gateway's config and turn app names into URLs.

    ``deployment_file`` overrides where app names are looked up. Raises ``ConfigError`` naming
    the config file, the key, the deployment file and the app when a name resolves to nothing.
    """
    config = load_config(path, ClientConfig)
    if not any(is_app_name(e) for key in _LISTS for e in getattr(config, key)):
        return config
    deployment = Path(deployment_file) if deployment_file else deployment_file_for(config, path)
    try:
        urls = app_urls(deployment)
    except ValueError as exc:
        raise ConfigError(f"{path}: a server list names a deployment app, but {exc}") from None
    resolved: dict[str, list[str]] = {}
    for key in _LISTS:
        resolved[key] = []
        for entry in getattr(config, key):
            if is_app_name(entry) and entry not in urls:
                raise ConfigError(
                    f"{path}: {key}: {entry!r} is no app of the deployment {deployment} "
                    f"(its apps: {', '.join(urls) or 'none'})"
                )
            resolved[key].append(urls[entry] if is_app_name(entry) else entry)
    # model_copy keeps the secrets as they are (a dump and re-validation would mask them).
    resolved_config = config.model_copy(update=resolved)
    try:
        check_listed_once(resolved_config)
    except ValueError as exc:
        raise ConfigError(f"{path}: with app names resolved from {deployment}: {exc}") from None
    return resolved_config
