"""DNS discovery across the test network, with the system resolver of the gateway's host.

``ip netns exec`` mounts ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``, so the gateway
host resolves ``cb.llm.test`` to whatever the test writes there: several hosts at once, then
others, as a Kubernetes headless Service does when pods come and go.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from harness.waiting import wait_until
from tests.multihost.conftest import MARK_BOUND_SECONDS, Hosts, start_gateway
from tests.multihost.load import MODEL

NAME = "cb.llm.test"


@pytest.fixture(scope="module")
def dns_gateway(deployment: Hosts) -> Iterator[httpx.Client]:
    """A second gateway on ``gw`` (port 8010) that knows its CB servers only by DNS name."""
    network, gw = deployment.network, deployment.host("gw")
    hosts = [deployment.host("cb1").address, deployment.host("cb2").address]
    network.write_hosts(gw, {NAME: hosts})  # before start: exec mounts it only if it exists
    http = start_gateway(
        deployment,
        "dns_gateway",
        8010,
        continuous_batching_server_dns={"name": NAME, "port": 8001, "scheme": "http"},
    )
    yield http
    http.close()


def _routable(http: httpx.Client) -> list[str]:
    rows = http.get("/backends").json()["backends"]
    return sorted(row["url"] for row in rows if row["is_healthy"])


def _listed(http: httpx.Client) -> list[str]:
    return sorted(row["url"] for row in http.get("/backends").json()["backends"])


def _served_by(http: httpx.Client, count: int) -> set[str]:
    """Which hosts answered ``count`` completions (fake hosts start with ``[name]``)."""
    names = set()
    for _ in range(count):
        answer = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}
        )
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["text"]
        names.add(text[1:].split("]")[0] if text.startswith("[") else "real")
    return names


def test_name_maps_to_several_hosts_and_follows_changes(
    deployment: Hosts, dns_gateway: httpx.Client
) -> None:
    cb1, cb2, cb3 = (deployment.url(name) for name in ("cb1", "cb2", "cb3"))
    wait_until(lambda: _routable(dns_gateway) == sorted([cb1, cb2]), 10, message="both hosts")
    assert "cb2" in _served_by(dns_gateway, 6)
    # The name now points at cb2 and cb3: cb1 leaves, cb3 joins after a good health check.
    gw = deployment.host("gw")
    addresses = [deployment.host("cb2").address, deployment.host("cb3").address]
    deployment.network.write_hosts(gw, {NAME: addresses})
    wait_until(
        lambda: (
            _listed(dns_gateway) == sorted([cb2, cb3])
            and _routable(dns_gateway) == sorted([cb2, cb3])
        ),
        MARK_BOUND_SECONDS + 2,
        interval=0.05,
        message="cb1 leaving and cb3 joining",
    )
    assert _served_by(dns_gateway, 8) == {"cb2", "cb3"}
    # The name disappears (NXDOMAIN): the known hosts stay, requests keep working.
    deployment.network.write_hosts(gw, {})
    wait_until(lambda: "did not resolve" in _log(deployment), 5, message="a failed lookup")
    assert _listed(dns_gateway) == sorted([cb2, cb3])
    assert _served_by(dns_gateway, 4) <= {"cb2", "cb3"}


def test_a_discovered_host_that_dies_is_marked_down(
    deployment: Hosts, dns_gateway: httpx.Client
) -> None:
    gw, cb3 = deployment.host("gw"), deployment.host("cb3")
    deployment.network.write_hosts(gw, {NAME: [deployment.host("cb2").address, cb3.address]})
    url = deployment.url("cb3")
    wait_until(lambda: url in _routable(dns_gateway), 5, message="cb3 routable")
    cb3.link(False)
    try:
        wait_until(
            lambda: url not in _routable(dns_gateway),
            MARK_BOUND_SECONDS + 0.5,
            interval=0.05,
            message="cb3 marked down",
        )
        assert _served_by(dns_gateway, 4) == {"cb2"}
    finally:
        cb3.heal()
    wait_until(lambda: url in _routable(dns_gateway), MARK_BOUND_SECONDS + 2, message="cb3 back")


def _log(deployment: Hosts) -> str:
    return (deployment.folder / "dns_gateway.log").read_text()


def test_a_host_leaving_dns_drains_its_streams(
    deployment: Hosts, dns_gateway: httpx.Client
) -> None:
    gw, cb1_url = deployment.host("gw"), deployment.url("cb1")
    deployment.network.write_hosts(gw, {NAME: [deployment.host("cb1").address]})
    wait_until(lambda: _routable(dns_gateway) == [cb1_url], 5, message="cb1 alone")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 160,
        "ignore_eos": True,  # a long answer from the real server: it outlives the change
        "stream": True,
    }
    lines: list[str] = []
    with dns_gateway.stream("POST", "/v1/chat/completions", json=body, timeout=60) as answer:
        assert answer.status_code == 200
        stream = answer.iter_lines()
        lines.append(next(stream))  # the stream runs on cb1 now
        deployment.network.write_hosts(gw, {NAME: [deployment.host("cb2").address]})
        wait_until(lambda: cb1_url not in _listed(dns_gateway), 5, message="cb1 leaving")
        # cb1 left the gateway's list while still generating this answer.
        health = httpx.get(f"{cb1_url}/health", timeout=5, trust_env=False).json()
        assert health["load"]["num_running"] >= 1, health
        lines += list(stream)
    assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines
    assert not [line for line in lines if '"error"' in line]
    assert len([line for line in lines if line.startswith("data: {")]) >= 100
