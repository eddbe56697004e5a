"""Our static-batching servers (``static_batching_server_app``): the second tier, used when
no continuous-batching server serving the model can take a request."""

from __future__ import annotations

from dataclasses import dataclass

from client.backends.kinds.our_server import OurServer, server_list_section


@dataclass(eq=False)
class StaticBatchingServer(OurServer):
    """One static-batching server: every generation request as sent, second tier."""

    kind = "static_batching"
    noun = "static-batching server"
    is_resumable = True
    tier = "second"
    urls_key = "static_batching_server_urls"
    dns_key = "static_batching_server_dns"
    section = server_list_section(
        "StaticBatchingSection",
        urls_key,
        "static-batching servers, URLs or deployment app names",
        dns_key,
    )
