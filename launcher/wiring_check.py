"""After ``up``: does every server a gateway's config lists exist? A URL that is no app of the
deployment and where nothing answers usually means a port was changed in one file and not in
the other; the gateway would then send that model's requests elsewhere (or nowhere) quietly."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from launcher.deployment import AppEntry, base_url, resolve_path
from launcher.startup import probe_health

_RED, _RESET = "\033[31m", "\033[0m"


def unmatched_gateway_urls(entries: Sequence[AppEntry]) -> list[str]:
    """One warning per server URL in a gateway's config that is no app of ``entries`` and
    where nothing answers (its config unreadable: no warning, the gateway reports it)."""
    from client.config.schema import ClientConfig  # the gateway's schema: only for `up`
    from utils.config import ConfigError, load_config

    app_urls = {base_url(entry.host, entry.port) for entry in entries}
    app_urls |= {url.replace("127.0.0.1", "localhost") for url in app_urls}
    warnings = []
    for gateway in (e for e in entries if e.enabled and e.role == "gateway" and e.config):
        path = resolve_path(gateway.config)  # type: ignore[arg-type]
        try:
            config = load_config(path, ClientConfig)
        except ConfigError:
            continue
        urls = [*config.continuous_batching_server_urls, *config.static_batching_server_urls]
        urls += [entry.url for entry in config.triton_server_urls]
        for url in urls:
            if url.rstrip("/") in app_urls or probe_health(url.rstrip("/"), 1.0)[0] is not None:
                continue
            warnings.append(
                f"gateway {gateway.name!r} ({gateway.config}) lists the server {url}, which is "
                "no app of this deployment, and nothing answers there: its requests will go to "
                "other servers or fail. Make the port in the gateway's config and in the "
                "deployment file the same."
            )
    return warnings


def warn(message: str) -> None:
    """Print ``warning: message`` on stderr, red on a terminal."""
    red, reset = (_RED, _RESET) if sys.stderr.isatty() else ("", "")
    print(f"{red}warning: {message}{reset}", file=sys.stderr, flush=True)
