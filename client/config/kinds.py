"""The backend kinds of the gateway, listed once: in :data:`KINDS`.

The gateway config is assembled from the kinds' sections (``client.config.schema``), so their
table lives here, beside it, rather than among the kinds: the kinds then import neither the
config nor each other (Triton's kind, in ``client.triton``, included). A kind is a
:class:`~client.backends.backend.Backend` subclass that owns its config keys (its
``section``), how its backends are built from the config, its health probe, its translation
and which requests it takes. Adding a kind (say, a TGI server speaking its own API) is one new
module and one line here.
"""

from __future__ import annotations

from pydantic import BaseModel

from client.backends.backend import Backend
from client.backends.kinds.continuous_batching import ContinuousBatchingServer
from client.backends.kinds.embedding import EmbeddingServer
from client.backends.kinds.openai_compatible import OpenAICompatibleUpstream
from client.backends.kinds.static_batching import StaticBatchingServer
from client.triton.server_kind import TritonServer

#: Every kind, in the order their backends are listed (and tried, within a tier and policy).
KINDS: tuple[type[Backend], ...] = (
    ContinuousBatchingServer,
    StaticBatchingServer,
    EmbeddingServer,
    TritonServer,
    OpenAICompatibleUpstream,
)


def backends_from_config(config: BaseModel) -> list[Backend]:
    """Fresh backends for every configured server and account of the gateway ``config``,
    kind by kind."""
    return [backend for kind in KINDS for backend in kind.from_config(config)]
