"""Our continuous-batching servers (``continuous_batching_server_app``): the first tier."""

from __future__ import annotations

from dataclasses import dataclass

from client.backends.kinds.our_server import OurServer, server_list_section


@dataclass(eq=False)
class ContinuousBatchingServer(OurServer):
    """One continuous-batching server: every generation request as sent, first tier."""

    kind = "continuous_batching"
    noun = "continuous-batching server"
    is_resumable = True
    urls_key = "continuous_batching_server_urls"
    dns_key = "continuous_batching_server_dns"
    section = server_list_section(
        "ContinuousBatchingSection",
        urls_key,
        "continuous-batching servers, URLs or deployment app names",
        dns_key,
    )
