"""The continuous-batching server: our paged-KV-cache engine behind the shared HTTP API.

Gunicorn calls ``build_app(config_path)`` (one worker: one engine per process);
``python continuous_batching_server_app.py --help`` runs it in the foreground with uvicorn.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from server.common.app import create_server_app
from server.common.compute_thread import ComputeThread
from server.common.entry import ServerEntry
from server.continuous_batching import huge_pages
from server.continuous_batching.async_engine import AsyncEngine
from server.continuous_batching.cb_server_config import load_cb_server_config
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.model import cpu_isa

logger = logging.getLogger(__name__)


def _build(config_path: str) -> FastAPI:
    """Load the config and the model, and return the ASGI app."""
    config = load_cb_server_config(config_path)
    loading = config.model_loading_config
    if loading.device == "cpu":
        # A forced lower ISA level caps torch and oneDNN too, before they run anything.
        cpu_isa.cap_torch_to(cpu_isa.resolve(loading.cpu_isa))
        # Weights and KV cache in 2 MB pages (read once by torch: before the model loads).
        is_huge = huge_pages.enable_for_torch()
        mode = huge_pages.system_mode()
        logger.info("huge pages for weights and KV cache: %s (THP %s)", is_huge, mode)
    # Loaded in the thread that will run it: one OpenMP team per process (compute_thread).
    compute = ComputeThread("engine")
    engine = compute.call(LLMEngine, config.engine_config())
    model_id = loading.served_model_id
    backend = AsyncEngine(engine, model_id, compute)
    settings = config.serving_config.settings(model_id)
    return create_server_app(backend, settings, title="Continuous-batching LLM server")


ENTRY = ServerEntry(__doc__, "configs/cb_server_config.json", 8001, _build)
build_app, main = ENTRY.build_app, ENTRY.main

if __name__ == "__main__":
    main()
