"""The two entry points of every model server module (``*_server_app.py``): gunicorn's
``build_app(config_path)`` and the foreground ``main()`` (``python <module>.py --help``).

A server module writes only how its app is built from its config file, and binds::

    ENTRY = ServerEntry(__doc__, "configs/x_server_config.json", 8001, _build)
    build_app, main = ENTRY.build_app, ENTRY.main
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI

from utils.logging import setup_logging

#: The log level of every app (INFO when unset).
LOG_LEVEL_ENV = "LLM_SUITE_LOG_LEVEL"


@dataclass(frozen=True)
class ServerEntry:
    """A model server's entry points around ``build``, which makes its app from a config file
    (the model loaded: one model per process)."""

    #: The module's docstring: its first line describes the server in ``--help``.
    doc: str
    default_config: str
    default_port: int
    build: Callable[[str], FastAPI]

    def build_app(self, config_path: str | None = None) -> FastAPI:
        """Set up logging (level from ``LLM_SUITE_LOG_LEVEL``), then build the app from
        ``config_path`` (default: the shipped config). Gunicorn calls this."""
        setup_logging(os.environ.get(LOG_LEVEL_ENV, "INFO"))
        return self.build(config_path or self.default_config)

    def main(self) -> None:
        """Run the server in the foreground (for development; use start_app.py to deploy)."""
        # Imported here: gunicorn workers, which only call build_app, never need it.
        from utils.serving import serve_from_command_line

        serve_from_command_line(
            self.build_app,
            description=self.doc.splitlines()[0],
            default_config=self.default_config,
            default_port=self.default_port,
        )
