"""Our embedding servers (``embedding_server_app``): ``POST /v1/embeddings`` only.

They report health and load on ``/health`` like the generation servers; no other kind of ours
embeds, so they share the first tier with nothing competing.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field

from client.backends.kinds.our_server import OurServer
from client.backends.plan import AS_SENT, Plan
from client.config.schema_common import ServerAddress
from client.endpoints import Endpoint
from client.gateway_request import GatewayRequest


class EmbeddingSection(BaseModel):
    """The gateway config's keys for embedding servers."""

    embedding_server_urls: list[ServerAddress] = Field(
        default_factory=list,
        description="embedding servers (embedding_server_app), URLs or deployment app names",
    )


@dataclass(eq=False)
class EmbeddingServer(OurServer):
    """One embedding server: embeddings as sent, nothing else."""

    kind = "embedding"
    noun = "embedding server"
    section = EmbeddingSection
    urls_key = "embedding_server_urls"

    def plan(self, request: GatewayRequest) -> Plan:
        """Embeddings requests go as the caller sent them; generation never comes here."""
        if request.endpoint == Endpoint.EMBEDDINGS:
            return AS_SENT
        return Plan(refusal=f"embedding servers do not answer {request.endpoint}")
