"""After ``up``: does every server a gateway's config lists exist? A URL that is no app of the
deployment and where nothing answers usually means a port was changed in one file and not in
the other; the gateway would then send that model's requests elsewhere (or nowhere) quietly.
(Servers named by their deployment app name instead of a URL cannot drift that way.)"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from launcher.deployment import AppEntry, base_url, resolve_path
from launcher.startup import probe_health

_RED, _RESET = "\033[31m", "\033[0m"


def unmatched_gateway_urls(
    entries: Sequence[AppEntry], deployment_file: str | Path | None = None
) -> list[str]:
    """One warning per server URL in a gateway's config that is no app of ``entries`` and
    where nothing answers (its config unreadable: no warning, the gateway reports it).

    ``deployment_file`` is where ``entries`` come from: the warning names it, and app names
    in the gateway's config are resolved from it.
    """
    # The gateway's config loader: imported here, only `up` needs it.
    from client.config.loading import load_client_config
    from utils.config import ConfigError

    app_urls = {base_url(entry.host, entry.port) for entry in entries}
    app_urls |= {url.replace("127.0.0.1", "localhost") for url in app_urls}
    where = f"deployment {deployment_file}" if deployment_file else "this deployment"
    warnings = []
    for gateway in (e for e in entries if e.enabled and e.role == "gateway" and e.config):
        path = resolve_path(gateway.config)  # type: ignore[arg-type]
        try:
            config = load_client_config(path, deployment_file)
        except ConfigError:
            continue
        urls = [*config.continuous_batching_server_urls, *config.static_batching_server_urls]
        urls += config.embedding_server_urls
        urls += [entry.url for entry in config.triton_server_urls]
        for url in urls:
            if url.rstrip("/") in app_urls or probe_health(url.rstrip("/"), 1.0)[0] is not None:
                continue
            warnings.append(
                f"gateway {gateway.name!r} ({path}) lists the server {url}, which is no app of "
                f"the {where}, and nothing answers there: its requests will go to other "
                "servers or fail. Make the port in the gateway's config and in the deployment "
                "file the same, or name the server by its app name in the gateway's config."
            )
    return warnings


def warn(message: str) -> None:
    """Print ``warning: message`` on stderr, red on a terminal."""
    red, reset = (_RED, _RESET) if sys.stderr.isatty() else ("", "")
    print(f"{red}warning: {message}{reset}", file=sys.stderr, flush=True)
