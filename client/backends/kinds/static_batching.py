"""Our static-batching servers (``static_batching_server_app``): the second tier, used when
no continuous-batching server serving the model can take a request."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field

from client.backends.kinds.our_server import OurServer
from client.config.schema_common import ServerAddress, ServerDNSConfig


class StaticBatchingSection(BaseModel):
    """The gateway config's keys for static-batching servers."""

    static_batching_server_urls: list[ServerAddress] = Field(
        default_factory=list, description="static-batching servers, URLs or deployment app names"
    )
    static_batching_server_dns: ServerDNSConfig | None = None


@dataclass(eq=False)
class StaticBatchingServer(OurServer):
    """One static-batching server: every generation request as sent, second tier."""

    kind = "static_batching"
    noun = "static-batching server"
    section = StaticBatchingSection
    is_resumable = True
    tier = "second"
    urls_key = "static_batching_server_urls"
    dns_key = "static_batching_server_dns"
