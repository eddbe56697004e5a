"""The static-batching server: packs requests that arrive together and runs transformers.

Gunicorn calls ``build_app(config_path)``; ``python static_batching_server_app.py --help``
runs it in the foreground with uvicorn instead.
"""

from __future__ import annotations

import os

from fastapi import FastAPI

from server.common.app import create_server_app
from server.static_batching.backend import StaticBatchingBackend
from server.static_batching.config import load_sb_server_config
from utils.logging import setup_logging

DEFAULT_CONFIG = "configs/sb_server_config.json"


def build_app(config_path: str = DEFAULT_CONFIG) -> FastAPI:
    """Load the config and the model, and return the ASGI app (one model per process)."""
    setup_logging(os.environ.get("LLM_SUITE_LOG_LEVEL", "INFO"))
    config = load_sb_server_config(config_path)
    backend = StaticBatchingBackend(config)
    settings = config.serving_config.settings(backend.model_id)
    return create_server_app(backend, settings, title="Static-batching LLM server")


def main() -> None:
    """Run the server in the foreground (for development; use start_app.py to deploy)."""
    from utils.serving import serve_from_command_line

    serve_from_command_line(
        build_app,
        description=__doc__.splitlines()[0],
        default_config=DEFAULT_CONFIG,
        default_port=8002,
    )


if __name__ == "__main__":
    main()
