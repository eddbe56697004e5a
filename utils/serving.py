"""How every app is served: uvicorn with the hardened HTTP protocol, in the foreground or as
gunicorn's worker.

uvicorn's ``http="auto"`` would pick the plain httptools protocol (text/plain errors, no
header or body timeouts); every place that serves an app goes through here instead, so the
limits of ``utils.connection_limits`` hold under ``python <app>.py`` and under gunicorn alike.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, Literal

import uvicorn
from uvicorn_worker import UvicornWorker

from utils.connection_limits import limits_of
from utils.http_protocol import HardenedH11Protocol, HardenedHttpToolsProtocol

#: The hardened protocol for each of uvicorn's HTTP parsers.
PROTOCOLS = {"httptools": HardenedHttpToolsProtocol, "h11": HardenedH11Protocol}


def uvicorn_options(app: Any, parser: Literal["httptools", "h11"] = "httptools") -> dict[str, Any]:
    """uvicorn ``Config`` keyword arguments that serve ``app`` with its connection limits
    (httptools, a dependency, by default: the faster parser)."""
    limits = limits_of(app)
    return {
        "http": PROTOCOLS[parser],
        # The protocol applies these itself; uvicorn's own values are set to agree.
        "timeout_keep_alive": limits.keep_alive_timeout_seconds,
        "limit_concurrency": None,
    }


def serve(app: Any, *, host: str, port: int, log_level: str = "info", **options: Any) -> None:
    """Serve ``app`` in the foreground (the apps' ``main``), hardened protocol included."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, **uvicorn_options(app), **options)


def serve_from_command_line(
    build_app: Callable[[str], Any], *, description: str, default_config: str, default_port: int
) -> None:
    """A model server's ``main``: parse ``--config``, ``--host`` (127.0.0.1) and ``--port``,
    build the app from the config and serve it in the foreground (for development; the
    launcher, ``start_app.py``, deploys under gunicorn)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=default_config, help="path of the server config JSON")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=default_port, help=f"port to bind (default {default_port})"
    )
    args = parser.parse_args()
    serve(build_app(args.config), host=args.host, port=args.port)


class HardenedUvicornWorker(UvicornWorker):
    """gunicorn's uvicorn worker serving with ``HardenedHttpToolsProtocol``.

    gunicorn's ``--keep-alive`` (2 s by default) would otherwise set uvicorn's keep-alive;
    the app's own ``keep_alive_timeout_seconds`` wins, as in the foreground.
    """

    CONFIG_KWARGS: dict[str, Any] = {"loop": "auto", "http": HardenedHttpToolsProtocol}

    async def _serve(self) -> None:
        # The app is loaded by now (``self.wsgi``): its limits decide the keep-alive.
        self.config.timeout_keep_alive = uvicorn_options(self.wsgi)["timeout_keep_alive"]
        await super()._serve()
