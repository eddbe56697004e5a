"""The static-batching server: packs requests that arrive together and runs transformers.

Gunicorn calls ``build_app(config_path)``; ``python static_batching_server_app.py --help``
runs it in the foreground with uvicorn instead.
"""

from __future__ import annotations

from fastapi import FastAPI

from server.common.app import create_server_app
from server.common.entry import ServerEntry
from server.static_batching.backend import StaticBatchingBackend
from server.static_batching.config import load_sb_server_config


def _build(config_path: str) -> FastAPI:
    """Load the config and the model, and return the ASGI app (one model per process)."""
    config = load_sb_server_config(config_path)
    backend = StaticBatchingBackend(config)
    settings = config.serving_config.settings(backend.model_id)
    return create_server_app(backend, settings, title="Static-batching LLM server")


ENTRY = ServerEntry(__doc__, "configs/sb_server_config.json", 8002, _build)
build_app, main = ENTRY.build_app, ENTRY.main

if __name__ == "__main__":
    main()
