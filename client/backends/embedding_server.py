"""Our embedding servers (``embedding_server_app``) as backends of the gateway.

They answer ``POST /v1/embeddings`` only, and report health and load on ``/health`` like the
generation servers, so everything but the plan is the common :class:`Backend`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from client.backends.base import AS_SENT, EMBEDDINGS_PATH, Backend, Plan
from client.gateway_request import GatewayRequest


@dataclass(eq=False)
class EmbeddingServer(Backend):
    """One embedding server: embeddings as sent, nothing else."""

    def plan(self, request: GatewayRequest) -> Plan:
        """Embeddings requests go as the caller sent them; generation never comes here."""
        if request.endpoint == EMBEDDINGS_PATH:
            return AS_SENT
        return Plan(refusal=f"embedding servers do not answer {request.endpoint}")
