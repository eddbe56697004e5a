"""Servers discovered from DNS: a name per server kind, resolved to all its addresses.

The gateway config may name a DNS entry (``{"name", "port", "scheme"}``) for each backend kind
that has one (``continuous_batching_server_dns``, ``static_batching_server_dns``,
``triton_server_dns``) besides the URL lists. At every
heartbeat each name is resolved again (a Kubernetes headless Service answers one A record per
ready pod); the addresses become server URLs added to the config's own lists, and the registry
applies that *effective* config through the same path as a config reload: new servers join
after a good health check, vanished ones get no new requests while those in flight finish.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

from client.config.kinds import KINDS
from client.config.schema import ClientConfig
from client.config.schema_common import ServerDNSConfig

logger = logging.getLogger(__name__)

#: ``(name, port) -> addresses``; raises ``OSError`` when the name does not resolve.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_all(name: str, port: int) -> list[str]:
    """Every address ``name`` resolves to, sorted (IPv4 first), each once.

    ``loop.getaddrinfo`` runs the system resolver in a worker thread, so a slow DNS server
    never blocks the event loop (and ``/etc/hosts``, nsswitch and search domains apply, as for
    any other program on the host).
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    addresses = {ipaddress.ip_address(info[4][0]) for info in infos}
    return [str(address) for address in sorted(addresses, key=lambda a: (a.version, a))]


def server_url(entry: ServerDNSConfig, address: str) -> str:
    """The base URL of the server at ``address`` (IPv6 literals in brackets)."""
    host = f"[{address}]" if ":" in address else address
    return f"{entry.scheme}://{host}:{entry.port}"


class DNSDiscovery:
    """Turns a config with DNS entries into the effective config with the discovered URLs.

    A name that fails to resolve (timeout, SERVFAIL, NXDOMAIN) keeps the addresses it last
    resolved to, with a warning: a DNS hiccup must not empty the backend list, and servers
    that are really gone are marked down by their failing heartbeats anyway.
    """

    def __init__(self, resolver: Resolver = resolve_all) -> None:
        self.resolver = resolver
        self._last: dict[tuple[str, int], list[str]] = {}

    async def addresses(self, entry: ServerDNSConfig, timeout_seconds: float) -> list[str]:
        """The current addresses of ``entry`` (the last known ones when resolution fails)."""
        key = (entry.name, entry.port)
        try:
            # wait_for bounds the wait; the resolver thread itself may linger, harmlessly.
            found = await asyncio.wait_for(self.resolver(entry.name, entry.port), timeout_seconds)
        except (OSError, TimeoutError) as exc:
            last = self._last.get(key, [])
            logger.warning(
                "DNS name %s did not resolve (%s: %s); keeping its %d known address(es)",
                entry.name,
                type(exc).__name__,
                exc,
                len(last),
            )
            return last
        if found != self._last.get(key):
            logger.info("DNS name %s resolves to %s", entry.name, found or "nothing")
        self._last[key] = found
        return found

    async def effective_config(self, config: ClientConfig, timeout_seconds: float) -> ClientConfig:
        """``config`` with the servers its DNS names resolve to added to its URL lists.

        Names are resolved concurrently. An address already listed (of any kind) is not added
        twice, so a server both listed and discovered keeps one backend.
        """
        entries = config.dns_entries
        if not entries:
            return config
        resolved = await asyncio.gather(
            *(self.addresses(entry, timeout_seconds) for _, entry in entries)
        )
        # An address already listed (of any kind) is not added twice.
        taken = {url for kind in KINDS for url in kind.listed_urls(config)}
        update: dict[str, object] = {}
        for (kind, entry), addresses in zip(entries, resolved, strict=True):
            fresh = [server_url(entry, address) for address in addresses]
            fresh = [url for url in fresh if url not in taken]
            taken.update(fresh)
            update.update(kind.with_discovered(config, fresh))
        # model_copy skips validation on purpose: the file config was validated, and the
        # additions are well-formed and disjoint from the lists by construction.
        return config.model_copy(update=update)
