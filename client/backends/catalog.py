"""Every backend kind, built from the gateway config: the one place that lists the kinds."""

from __future__ import annotations

from client.backends.base import Backend
from client.backends.embedding_server import EmbeddingServer
from client.backends.openai_compatible import OpenAICompatibleServer
from client.backends.openai_upstream import make_jumpers
from client.backends.triton_server import TritonBackend
from client.config.schema import ClientConfig


def backends_from_config(config: ClientConfig) -> list[Backend]:
    """Fresh backends for every configured server and key, in routing order: CB servers, SB
    servers, embedding servers, Triton servers, OpenAI-compatible engines, then the OpenAI
    jumper keys (placeholder keys skipped)."""
    backends: list[Backend] = [
        Backend(url=url, kind="continuous_batching")
        for url in config.continuous_batching_server_urls
    ]
    backends += [
        Backend(url=url, kind="static_batching") for url in config.static_batching_server_urls
    ]
    backends += [EmbeddingServer(url=url, kind="embedding") for url in config.embedding_server_urls]
    backends += [TritonBackend.from_config(entry) for entry in config.triton_server_urls]
    backends += [
        OpenAICompatibleServer.from_config(entry) for entry in config.openai_compatible_server_urls
    ]
    backends += make_jumpers(config.openai_jumper_configs)
    return backends
