"""The static-batching server: packs requests that arrive together and runs transformers.

Gunicorn calls ``build_app(config_path)``; ``python static_batching_server_app.py --help``
runs it in the foreground with uvicorn instead.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

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
    from utils.serving import serve

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="path of the server config JSON")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8002, help="port to bind (default 8002)")
    args = parser.parse_args()
    serve(build_app(str(Path(args.config))), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
