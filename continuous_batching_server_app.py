"""The continuous-batching server: our paged-KV-cache engine behind the shared HTTP API.

Gunicorn calls ``build_app(config_path)`` (one worker: one engine per process);
``python continuous_batching_server_app.py --help`` runs it in the foreground with uvicorn.
"""

from __future__ import annotations

import os

from fastapi import FastAPI

from server.common.app import create_server_app
from server.common.compute_thread import ComputeThread
from server.continuous_batching.async_engine import AsyncEngine
from server.continuous_batching.cb_server_config import load_cb_server_config
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.model import cpu_isa
from utils.logging import setup_logging

DEFAULT_CONFIG = "configs/cb_server_config.json"


def build_app(config_path: str = DEFAULT_CONFIG) -> FastAPI:
    """Load the config and the model, and return the ASGI app."""
    setup_logging(os.environ.get("LLM_SUITE_LOG_LEVEL", "INFO"))
    config = load_cb_server_config(config_path)
    loading = config.model_loading_config
    if loading.device == "cpu":
        # A forced lower ISA level caps torch and oneDNN too, before they run anything.
        cpu_isa.cap_torch_to(cpu_isa.resolve(loading.cpu_isa))
    # Loaded in the thread that will run it: one OpenMP team per process (compute_thread).
    compute = ComputeThread("engine")
    engine = compute.call(LLMEngine, config.engine_config())
    model_id = loading.served_model_id
    backend = AsyncEngine(engine, model_id, compute)
    settings = config.serving_config.settings(model_id)
    return create_server_app(backend, settings, title="Continuous-batching LLM server")


def main() -> None:
    """Run the server in the foreground (for development; use start_app.py to deploy)."""
    from utils.serving import serve_from_command_line

    serve_from_command_line(
        build_app,
        description=__doc__.splitlines()[0],
        default_config=DEFAULT_CONFIG,
        default_port=8001,
    )


if __name__ == "__main__":
    main()
