"""The backend kinds of the gateway, one module each, listed once: in :data:`KINDS`.

A kind is a :class:`~client.backends.backend.Backend` subclass that owns its config keys (its
``section``), how its backends are built from the config, its health probe, its translation
and which requests it takes. Adding a kind (say, a TGI server speaking its own API) is one new
module and one line here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from client.backends.backend import Backend
from client.backends.kinds.continuous_batching import ContinuousBatchingServer
from client.backends.kinds.embedding import EmbeddingServer
from client.backends.kinds.openai_compatible import OpenAICompatibleUpstream
from client.backends.kinds.static_batching import StaticBatchingServer
from client.triton.server_kind import TritonServer

if TYPE_CHECKING:
    from client.config.schema import ClientConfig

#: Every kind, in the order their backends are listed (and tried, within a tier and policy).
KINDS: tuple[type[Backend], ...] = (
    ContinuousBatchingServer,
    StaticBatchingServer,
    EmbeddingServer,
    TritonServer,
    OpenAICompatibleUpstream,
)


def backends_from_config(config: ClientConfig) -> list[Backend]:
    """Fresh backends for every configured server and account, kind by kind."""
    return [backend for kind in KINDS for backend in kind.from_config(config)]
