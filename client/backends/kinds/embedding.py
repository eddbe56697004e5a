"""Our embedding servers (``embedding_server_app``): ``POST /v1/embeddings`` only.

They report health and load on ``/health`` like the generation servers; no other kind of ours
embeds, so they share the first tier with nothing competing.
"""

from __future__ import annotations

from dataclasses import dataclass

from client.backends.kinds.our_server import OurServer, server_list_section
from client.backends.plan import AS_SENT, Plan
from client.endpoints import Endpoint
from client.gateway_request import GatewayRequest


@dataclass(eq=False)
class EmbeddingServer(OurServer):
    """One embedding server: embeddings as sent, nothing else."""

    kind = "embedding"
    noun = "embedding server"
    urls_key = "embedding_server_urls"
    section = server_list_section(
        "EmbeddingSection",
        urls_key,
        "embedding servers (embedding_server_app), URLs or deployment app names",
    )

    def plan(self, request: GatewayRequest) -> Plan:
        """Embeddings requests go as the caller sent them; generation never comes here."""
        if request.endpoint == Endpoint.EMBEDDINGS:
            return AS_SENT
        return Plan(refusal=f"embedding servers do not answer {request.endpoint}")
