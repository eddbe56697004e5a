"""Servers discovered from DNS: the resolver step alone, then a real gateway over fake servers
whose addresses come and go (a fake resolver), then the system resolver on ``localhost``."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from client.backends.lease import InFlightLease
from client.balancing.discovery import DNSDiscovery, resolve_all, server_url
from client.config.schema import ClientConfig
from client.config.schema_common import ServerDNSConfig
from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import ServerThread, start_gateway, stop_all
from harness.waiting import wait_until

GENERATE = {"model": "fake-model", "prompt": "hi", "generation_config": {"max_new_tokens": 4}}


class FakeResolver:
    """A resolver whose answers the test sets (``None``: the name does not resolve)."""

    def __init__(self, answers: dict[str, list[str] | None]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.calls.append(name)
        found = self.answers.get(name)
        if found is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(found)


def _config(**fields: object) -> ClientConfig:
    return ClientConfig.model_validate(fields)


def test_effective_config_adds_discovered_servers_of_each_kind() -> None:
    resolver = FakeResolver(
        {"cb": ["10.0.0.1", "10.0.0.2"], "sb": ["10.0.0.2", "fd00::3"], "tr": ["10.0.0.9"]}
    )
    config = _config(
        continuous_batching_server_urls=["http://10.0.0.1:8001"],
        continuous_batching_server_dns={"name": "cb", "port": 8001},
        static_batching_server_dns={"name": "sb", "port": 8002, "scheme": "https"},
        triton_server_dns={"name": "tr", "port": 8000, "models": {"m": "ensemble"}},
    )
    effective = asyncio.run(DNSDiscovery(resolver).effective_config(config, 1.0))
    # The listed server is not added twice; IPv6 literals get brackets.
    assert effective.continuous_batching_server_urls == [
        "http://10.0.0.1:8001",
        "http://10.0.0.2:8001",
    ]
    assert effective.static_batching_server_urls == [
        "https://10.0.0.2:8002",
        "https://[fd00::3]:8002",
    ]
    [triton] = effective.triton_server_urls
    assert (triton.url, triton.models) == ("http://10.0.0.9:8000", {"m": "ensemble"})
    # The file config itself is untouched (a reload compares against it).
    assert config.continuous_batching_server_urls == ["http://10.0.0.1:8001"]


def test_failed_resolution_keeps_the_last_known_addresses() -> None:
    resolver = FakeResolver({"cb": ["10.0.0.1"]})
    discovery = DNSDiscovery(resolver)
    entry = ServerDNSConfig(name="cb", port=1)
    assert asyncio.run(discovery.addresses(entry, 1.0)) == ["10.0.0.1"]
    resolver.answers["cb"] = None  # NXDOMAIN / SERVFAIL: a hiccup must not empty the list
    assert asyncio.run(discovery.addresses(entry, 1.0)) == ["10.0.0.1"]
    resolver.answers["cb"] = []  # an answer with no address is an answer
    assert asyncio.run(discovery.addresses(entry, 1.0)) == []
    # A name never resolved has nothing to keep.
    assert asyncio.run(discovery.addresses(ServerDNSConfig(name="x", port=1), 1.0)) == []


def test_slow_resolver_is_bounded_by_the_timeout() -> None:
    async def never(name: str, port: int) -> list[str]:
        await asyncio.sleep(60)
        return []

    entry = ServerDNSConfig(name="slow", port=1)
    assert asyncio.run(asyncio.wait_for(DNSDiscovery(never).addresses(entry, 0.05), 5)) == []


def test_system_resolver_and_urls() -> None:
    assert "127.0.0.1" in asyncio.run(resolve_all("localhost", 80))
    assert server_url(ServerDNSConfig(name="n", port=9), "::1") == "http://[::1]:9"


def _loopback_servers(count: int) -> list[tuple[ServerThread, FakeServerSettings]]:
    """Fake servers on 127.0.0.2, 127.0.0.3, ... all on one port (as pods behind a Service)."""
    for _ in range(20):
        socks: list[socket.socket] = []
        try:
            for i in range(count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
                socks.append(sock)
                port = socks[0].getsockname()[1] if i else 0
                sock.bind((f"127.0.0.{i + 2}", port))
        except OSError:  # that port is taken on one of the addresses: try another
            for sock in socks:
                sock.close()
            continue
        servers = []
        for i, sock in enumerate(socks):
            settings = FakeServerSettings(name=f"S{i}", kind="continuous_batching")
            servers.append((start_fake_server(settings, sock), settings))
        return servers
    raise RuntimeError("no free port on the 127.0.0.x addresses")


@pytest.fixture
def three_pods() -> Iterator[list[tuple[ServerThread, FakeServerSettings]]]:
    """Three fake CB servers that a DNS name may point at."""
    servers = _loopback_servers(3)
    yield servers
    stop_all(*(server for server, _ in servers))


def test_gateway_follows_dns_answers(tmp_path: Path, three_pods: list) -> None:
    port = int(three_pods[0][0].url.rsplit(":", 1)[1])
    addresses = [f"127.0.0.{i + 2}" for i in range(3)]
    resolver = FakeResolver({"pods.test": addresses[:2]})
    gateway = start_gateway(
        tmp_path,
        continuous_batching_server_dns={"name": "pods.test", "port": port},
        heart_beat_interval_seconds=0.1,
        config_watch_interval_seconds=0,
    )
    try:
        registry = gateway.app.state.gateway.registry
        registry.discovery.resolver = resolver  # the first round used the system resolver

        def routable() -> list[str]:
            return sorted(backend.url for backend in registry.healthy())

        urls = [f"http://{address}:{port}" for address in addresses]
        wait_until(lambda: routable() == urls[:2], 5, message="the two first pods")
        # A request in flight on a pod that then leaves DNS finishes (it drains).
        leaving = next(b for b in registry.backends if b.url == urls[0])
        lease = InFlightLease(leaving)
        resolver.answers["pods.test"] = addresses[1:]
        wait_until(lambda: routable() == urls[1:], 5, message="pod 0 leaving, pod 2 joining")
        assert leaving not in registry.backends
        lease.release(is_failure=False)
        assert leaving.num_in_flight == 0
        answers = [gateway.http.post("/generate", json=GENERATE) for _ in range(6)]
        assert all(answer.status_code == 200 for answer in answers)
        served = {answer.json()["choices"][0]["text"].split("]")[0] for answer in answers}
        assert served == {"[S1", "[S2"}
        assert not three_pods[0][1].requests
        # A DNS failure keeps the known pods; the table shows them.
        resolver.answers["pods.test"] = None
        calls = len(resolver.calls)
        wait_until(lambda: len(resolver.calls) > calls + 2, 5, message="more DNS rounds")
        assert routable() == urls[1:]
        table = gateway.http.get("/backends").json()["backends"]
        assert sorted(row["url"] for row in table) == urls[1:]
    finally:
        stop_all(gateway)


def test_gateway_resolves_localhost_with_the_system_resolver(tmp_path: Path) -> None:
    settings = FakeServerSettings(name="L", kind="continuous_batching")
    server = start_fake_server(settings)
    port = int(server.url.rsplit(":", 1)[1])
    gateway = start_gateway(
        tmp_path, continuous_batching_server_dns={"name": "localhost", "port": port}
    )
    try:
        answer = gateway.http.post("/generate", json=GENERATE)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"].startswith("[L]")
        urls = [row["url"] for row in gateway.http.get("/backends").json()["backends"]]
        assert f"http://127.0.0.1:{port}" in urls
    finally:
        stop_all(gateway, server)
