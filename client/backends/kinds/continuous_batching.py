"""Our continuous-batching servers (``continuous_batching_server_app``): the first tier."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field

from client.backends.kinds.our_server import OurServer
from client.config.schema_common import ServerAddress, ServerDNSConfig


class ContinuousBatchingSection(BaseModel):
    """The gateway config's keys for continuous-batching servers."""

    continuous_batching_server_urls: list[ServerAddress] = Field(
        default_factory=list,
        description="continuous-batching servers, URLs or deployment app names",
    )
    continuous_batching_server_dns: ServerDNSConfig | None = None


@dataclass(eq=False)
class ContinuousBatchingServer(OurServer):
    """One continuous-batching server: every generation request as sent, first tier."""

    kind = "continuous_batching"
    noun = "continuous-batching server"
    section = ContinuousBatchingSection
    is_resumable = True
    urls_key = "continuous_batching_server_urls"
    dns_key = "continuous_batching_server_dns"
