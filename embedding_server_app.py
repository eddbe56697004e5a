"""The embedding server: a Hugging Face encoder with its sentence-transformers pooling behind
OpenAI's ``POST /v1/embeddings``, batching the inputs of requests that arrive together.

Gunicorn calls ``build_app(config_path)``; ``python embedding_server_app.py --help`` runs it in
the foreground with uvicorn instead.
"""

from __future__ import annotations

import os

import torch
from fastapi import FastAPI

from server.embedding.app import create_embedding_app
from server.embedding.config import load_embedding_server_config
from server.embedding.encoder import Encoder
from utils.logging import setup_logging

DEFAULT_CONFIG = "configs/embedding_server_config.json"


def build_app(config_path: str = DEFAULT_CONFIG) -> FastAPI:
    """Load the config and the encoder, and return the ASGI app (one model per process)."""
    setup_logging(os.environ.get("LLM_SUITE_LOG_LEVEL", "INFO"))
    config = load_embedding_server_config(config_path)
    encoder_config = config.encoder_config
    if encoder_config.num_threads:
        torch.set_num_threads(encoder_config.num_threads)
    encoder = Encoder(
        encoder_config.resolved_model_path(config.config_file),
        device=encoder_config.device,
        dtype=getattr(torch, encoder_config.torch_dtype),
    )
    return create_embedding_app(encoder, config)


def main() -> None:
    """Run the server in the foreground (for development; use start_app.py to deploy)."""
    from utils.serving import serve_from_command_line

    serve_from_command_line(
        build_app,
        description=__doc__.splitlines()[0],
        default_config=DEFAULT_CONFIG,
        default_port=8003,
    )


if __name__ == "__main__":
    main()
