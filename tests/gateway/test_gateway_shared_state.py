"""Two real gateway processes sharing circuit openings through a real redis-server.

A key rate-limited through one replica rests on both; a server whose requests fail through
one replica is avoided by both; with Redis gone each replica goes on with its own state, with
a warning, and requests keep working.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.fake_model_server import FakeServerSettings, start_fake_server
from tests.support.servers import ServerThread, stop_all
from tests.support.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A redis-server of the test's own on a free port (Debian's package; make test installs it)."""
    binary = shutil.which("redis-server")
    if binary is None:
        reason = "redis-server is missing (apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    port = _free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen([*args, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)

    def pong() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")

    wait_until(pong, 10, interval=0.05, ignoring=(OSError,), message="redis-server")
    yield f"redis://127.0.0.1:{port}/0", process
    process.terminate()
    process.wait(timeout=10)


def _start_gateway(tmp_path: Path, name: str, config: dict) -> tuple[httpx.Client, Path]:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    port, log = _free_port(), tmp_path / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "client_app.py", "--config", str(path), "--port", str(port)],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    _processes.append(process)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False)
    wait_until(
        lambda: http.get("/health").status_code == 200,
        30,
        interval=0.1,
        ignoring=(httpx.HTTPError,),
        message=lambda: f"gateway {name}: {log.read_text()[-2000:]}",
    )
    return http, log


_processes: list[subprocess.Popen[bytes]] = []


@pytest.fixture
def upstream() -> Iterator[tuple[ServerThread, FakeServerSettings]]:
    """An OpenAI-compatible upstream where key sk-one is rate-limited (429, Retry-After 7)."""
    settings = FakeServerSettings(name="up", fail_status_by_key={"sk-one": 429})
    server = start_fake_server(settings)
    yield server, settings
    stop_all(server)
    for process in _processes:
        process.terminate()
        process.wait(timeout=10)
    _processes.clear()


def _row(http: httpx.Client, name: str) -> dict:
    rows = http.get("/backends").json()["backends"]
    return next(row for row in rows if row["name"] == name)


def test_replicas_share_key_rests_and_circuit_openings(
    tmp_path: Path, redis_url: tuple, upstream: tuple
) -> None:
    url, redis_process = redis_url
    server, settings = upstream
    broken_settings = FakeServerSettings(name="broken", model_id="local-model", fail_status=500)
    broken = start_fake_server(broken_settings)
    try:
        jumper = {"base_url": f"{server.url}/v1", "models": ["fake-model"]}
        config = {
            "continuous_batching_server_urls": [broken.url],
            "openai_jumper_configs": [{**jumper, "api_key": k} for k in ("sk-one", "sk-two")],
            "heart_beat_interval_seconds": 60,
            "circuit_breaker_failures": 2,
            "circuit_breaker_cooldown_seconds": 30,
            "config_watch_interval_seconds": 0,
            "shared_state_url": url,
        }
        (a, _), (b, log_b) = (
            _start_gateway(tmp_path, "a", config),
            _start_gateway(tmp_path, "b", config),
        )
        key_one = f"openai[0]@{server.url}/v1"
        # Through A: sk-one answers 429 and rests; the request moves on to sk-two.
        assert a.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert settings.authorizations == ["Bearer sk-one", "Bearer sk-two"]
        assert _row(a, key_one)["circuit"] == "open"
        # B learns it without trying the key itself, and its requests skip sk-one.
        wait_until(lambda: _row(b, key_one)["circuit"] == "open", 5, message="B: sk-one rests")
        for _ in range(3):
            assert b.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert settings.authorizations.count("Bearer sk-one") == 1
        # A server failing its requests through A: its circuit opens on B as well.
        local = {"model": "local-model", "prompt": "hi"}
        for _ in range(2):
            assert a.post("/v1/completions", json=local).status_code >= 500
        assert _row(a, broken.url)["circuit"] == "open"
        wait_until(lambda: _row(b, broken.url)["circuit"] == "open", 5, message="B: circuit")
        num_broken = len(broken_settings.requests)
        assert b.post("/v1/completions", json=local).status_code == 503
        assert len(broken_settings.requests) == num_broken
        # Redis goes away: each replica keeps its own state, requests keep working.
        redis_process.terminate()
        redis_process.wait(timeout=10)
        for http in (a, b):
            for _ in range(2):
                assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        wait_until(lambda: "unreachable" in log_b.read_text(), 5, message="B's warning")
        assert _row(b, broken.url)["circuit"] == "open"
    finally:
        stop_all(broken)
