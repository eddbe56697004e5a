"""The multi-host deployment: test hosts as network namespaces on one bridge.

Hosts (addresses in ``10.213.0.0/24``; the test process calls from the bridge's ``.1``):

- ``gw`` (.10): the gateway (port 8000) over ``cb1``, ``cb2`` and ``sb``;
- ``cb1`` (.11): one real CB server with the real default model (port 8001);
- ``cb2`` (.12), ``cb3`` (.14): fake fast CB servers announcing the same model (port 8001);
- ``sb`` (.13): a fake SB server announcing the same model (port 8002);
- ``rgw`` (.20), ``rcb1`` (.21), ``rcb2`` (.22): ``test_resume_faults``' own gateway and two
  real CB servers (float32), added to the same bridge (:func:`test_network`) for that module.

Only one real model server runs for the deployment (two more, idle but for that module's own
streams, while ``test_resume_faults`` runs), so the whole suite fits a 2-core CI machine; the
faults hit a fake host, so the callers' answers after failover come from the real server.
Every app binds its host's own address, never 127.0.0.1.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.fake_server import fake_servers_args
from harness.processes import cb_server_config, gateway_client
from harness.waiting import wait_until
from tests.multihost.load import MODEL
from tests.multihost.netns import Host, NetnsUnavailable, TestNetwork

HEARTBEAT_SECONDS = 1.0
HEALTH_TIMEOUT_SECONDS = 1.0
#: The bound the issue sets for marking a host down (and the one we hold heal-up to).
MARK_BOUND_SECONDS = 2 * HEARTBEAT_SECONDS + HEALTH_TIMEOUT_SECONDS
LOCK_PATH = Path("/run/lock/llm-suite-multihost.lock")


@dataclass
class Hosts:
    """The running hosts and a client of the gateway."""

    network: TestNetwork
    folder: Path
    http: httpx.Client

    def host(self, name: str) -> Host:
        """The host called ``name``."""
        return self.network.hosts[name]

    def url(self, name: str, port: int = 8001) -> str:
        """The base URL of a server on host ``name``."""
        return f"http://{self.host(name).address}:{port}"

    def backend(self, url: str, http: httpx.Client | None = None) -> dict[str, Any]:
        """The gateway's row for the server at ``url``."""
        rows = (http or self.http).get("/backends", timeout=5).json()["backends"]
        return next(row for row in rows if row["url"] == url)


def _unavailable(reason: str) -> None:
    # CI runs as root with iproute2 and iptables installed (make test): there a missing
    # namespace is a broken build, not a reason to skip.
    if os.environ.get("CI"):
        pytest.fail(f"multi-host tests cannot run on CI: {reason}")
    pytest.skip(f"multi-host tests need network namespaces: {reason}")


def _gateway_config(folder: Path, name: str, **fields: Any) -> Path:
    config = {
        "heart_beat_interval_seconds": HEARTBEAT_SECONDS,
        "health_timeout_seconds": HEALTH_TIMEOUT_SECONDS,
        "num_failures_to_mark_down": 1,
        "connect_timeout_seconds": 1,
        "request_timeout_seconds": 5,
        "config_watch_interval_seconds": 0,
        **fields,
    }
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def start_gateway(deployment: Hosts, name: str, port: int, **fields: Any) -> httpx.Client:
    """Start a gateway on the ``gw`` host and return a client of it (waits until it answers)."""
    folder, gw = deployment.folder, deployment.host("gw")
    config = _gateway_config(folder, name, **fields)
    args = ["client_app.py", "--config", str(config), "--host", gw.address, "--port", str(port)]
    gw.spawn([*args, "--log-level", "warning"], folder / f"{name}.log")
    return gateway_client(f"http://{gw.address}:{port}", folder / f"{name}.log", name)


@pytest.fixture(scope="session")
def test_network() -> Iterator[TestNetwork]:
    """The bridge, with no host yet; every host on it is removed at teardown.

    One per session (and one run per machine): modules that need hosts of their own add them
    here (addresses apart from :func:`deployment`'s) instead of opening a second network on
    the same address range.
    """
    try:
        TestNetwork.preflight()  # before the lock: /run/lock may not be writable then
    except NetnsUnavailable as exc:
        _unavailable(str(exc))
    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    with LOCK_PATH.open("w") as lock:
        # One run at a time on this machine: the runs would share the address range.
        fcntl.flock(lock, fcntl.LOCK_EX)
        network = TestNetwork("llmt")
        try:
            network.open()
        except NetnsUnavailable as exc:
            _unavailable(str(exc))
        try:
            yield network
        finally:
            network.close()


@pytest.fixture(scope="session")
def deployment(
    test_network: TestNetwork, tmp_path_factory: pytest.TempPathFactory, default_model_path: Path
) -> Iterator[Hosts]:
    """The hosts, their servers and the gateway, all healthy; removed at teardown."""
    yield from _deploy(test_network, tmp_path_factory.mktemp("multihost"), default_model_path)


def _deploy(network: TestNetwork, folder: Path, model_path: Path) -> Iterator[Hosts]:
    for index, name in ((10, "gw"), (11, "cb1"), (12, "cb2"), (13, "sb"), (14, "cb3")):
        network.add_host(name, index)
    hosts = network.hosts
    cb_config = folder / "cb1.json"
    cb_config.write_text(json.dumps(cb_server_config(model_path, "bfloat16")))
    cb1 = hosts["cb1"]
    cb1.spawn(
        ["continuous_batching_server_app.py", "--config", str(cb_config)]
        + ["--host", cb1.address, "--port", "8001"],
        folder / "cb1.log",
    )
    for name, kind, port in (
        ("cb2", "continuous_batching", 8001),
        ("cb3", "continuous_batching", 8001),
        ("sb", "static_batching", 8002),
    ):
        host = hosts[name]
        # Slow enough streams (8 events, 50 ms apart) that a fault can catch one mid-answer.
        fake = {"name": name, "model_id": MODEL, "kind": kind, "num_stream_events": 8}
        fake["stream_delay_seconds"] = 0.05
        host.spawn(fake_servers_args(host.address, {port: fake}), folder / f"{name}.log")
    deployment = Hosts(network, folder, httpx.Client())
    deployment.http = start_gateway(
        deployment,
        "gateway",
        8000,
        continuous_batching_server_urls=[deployment.url("cb1"), deployment.url("cb2")],
        static_batching_server_urls=[deployment.url("sb", 8002)],
    )

    def all_healthy() -> bool:
        rows = deployment.http.get("/backends").json()["backends"]
        return all(row["is_healthy"] for row in rows)

    wait_until(
        all_healthy,
        180,  # the real CB server loads the model first
        interval=0.2,
        message=lambda: (
            f"all backends healthy; cb1 log: {(folder / 'cb1.log').read_text()[-3000:]}"
        ),
    )
    try:
        yield deployment
    finally:
        deployment.http.close()
