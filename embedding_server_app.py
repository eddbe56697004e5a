"""The embedding server: a Hugging Face encoder with its sentence-transformers pooling behind
OpenAI's ``POST /v1/embeddings``, batching the inputs of requests that arrive together.

Gunicorn calls ``build_app(config_path)``; ``python embedding_server_app.py --help`` runs it in
the foreground with uvicorn instead.
"""

from __future__ import annotations

import torch
from fastapi import FastAPI

from server.common.entry import ServerEntry
from server.embedding.app import create_embedding_app
from server.embedding.config import load_embedding_server_config
from server.embedding.encoder import Encoder


def _build(config_path: str) -> FastAPI:
    """Load the config and the encoder, and return the ASGI app (one model per process)."""
    config = load_embedding_server_config(config_path)
    encoder_config = config.encoder_config
    if encoder_config.num_threads:
        torch.set_num_threads(encoder_config.num_threads)
    encoder = Encoder(
        config.model_folder(),
        device=encoder_config.device,
        dtype=getattr(torch, encoder_config.torch_dtype),
    )
    return create_embedding_app(encoder, config)


ENTRY = ServerEntry(__doc__, "configs/embedding_server_config.json", 8003, _build)
build_app, main = ENTRY.build_app, ENTRY.main

if __name__ == "__main__":
    main()
