"""Two real gateway processes sharing circuit openings through a real redis-server.

A key rate-limited through one replica rests on both; a server whose requests fail through
one replica is avoided by both; with Redis gone each replica goes on with its own state, with
a warning, and requests keep working. Then :class:`SharedBreakerState` alone against a real
redis-server restarted on its port: one warning per outage (without the password), openings
made during an outage written again when Redis is back, a write never shortening a longer
opening, a pooled connection that died while idle not counted as an outage. The chaos runs
(two replicas under load, Redis killed, a replica killed, a replica cut off) are in
``test_replicas_chaos.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import asyncio as redis_asyncio

from client.balancing.shared_state import SharedBreakerState, backend_key, redacted_url
from harness.fake_server import FakeServerSettings, start_fake_server
from harness.network import free_port
from harness.processes import Deployment, gateway_client
from harness.redis_server import MISSING, RedisServer, is_redis_installed
from harness.servers import ServerThread, stop_all
from harness.waiting import wait_until
from tests.gateway.backend_factory import healthy_server

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def _start_redis(tmp_path: Path, password: str | None = None) -> RedisServer:
    """A redis-server on a free port (Debian's package; make test installs it), answering PING."""
    if not is_redis_installed():
        if os.environ.get("CI"):
            pytest.fail(MISSING)
        pytest.skip(MISSING)
    return RedisServer(tmp_path, password=password).start().wait()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own on a free port."""
    server = _start_redis(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[Deployment]:
    """Where the test's gateway processes run; they are stopped at teardown."""
    deployment = Deployment(tmp_path, num_servers=0)
    yield deployment
    deployment.stop(timeout=10)


def _start_gateway(deployment: Deployment, name: str, config: dict) -> tuple[httpx.Client, Path]:
    port = free_port()
    deployment.start_gateway(config, name, port, log_level=None)
    log = deployment.log_path(name)
    return gateway_client(f"http://127.0.0.1:{port}", log, name), log


@pytest.fixture
def upstream() -> Iterator[tuple[ServerThread, FakeServerSettings]]:
    """An OpenAI-compatible upstream where key sk-one is rate-limited (429, Retry-After 7)."""
    settings = FakeServerSettings(name="up", fail_status_by_key={"sk-one": 429})
    server = start_fake_server(settings)
    yield server, settings
    stop_all(server)


def _row(http: httpx.Client, name: str) -> dict:
    rows = http.get("/backends").json()["backends"]
    return next(row for row in rows if row["name"] == name)


def test_replicas_share_key_rests_and_circuit_openings(
    redis: RedisServer, gateways: Deployment, upstream: tuple
) -> None:
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
            "shared_state_url": redis.url(),
        }
        (a, _), (b, log_b) = (
            _start_gateway(gateways, "a", config),
            _start_gateway(gateways, "b", config),
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
        redis.stop()
        for http in (a, b):
            for _ in range(2):
                assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        wait_until(lambda: "unreachable" in log_b.read_text(), 5, message="B's warning")
        assert _row(b, broken.url)["circuit"] == "open"
    finally:
        stop_all(broken)


# -- SharedBreakerState alone against a real redis-server ---------------------------------------

PASSWORD = "unit-secret-pw-7"


def test_redacted_url_masks_the_password_only() -> None:
    assert redacted_url("redis://:pw@host:6379/0") == "redis://:***@host:6379/0"
    assert redacted_url("rediss://user:pw@host/1") == "rediss://user:***@host/1"
    assert redacted_url("redis://host:6379/0") == "redis://host:6379/0"
    assert redacted_url("redis://:pw@[::1]:6379/0") == "redis://:***@[::1]:6379/0"


async def test_outage_one_warning_replays_own_openings_and_keeps_the_longer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    redis = _start_redis(tmp_path, PASSWORD)
    url = redis.url()
    backend = healthy_server("http://127.0.0.1:9", "continuous_batching", ["m"])
    other = healthy_server("http://127.0.0.1:10", "continuous_batching", ["m"])
    state, peer = SharedBreakerState(url), SharedBreakerState(url)
    state.attach([backend, other])
    direct = redis_asyncio.from_url(url)
    key = backend_key(backend)
    caplog.set_level(logging.INFO, logger="client.balancing.shared_state")
    try:
        await state.sync([backend])
        # Redis dies: syncs fail, and an opening made now cannot be written.
        redis.kill()
        for _ in range(3):
            await state.sync([backend])
        backend.health.breaker.open_for(60)
        await asyncio.sleep(0.1)  # the background write fails at once (refused)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings  # one per outage, not one per failed call
        assert not state.is_available
        # Back, empty: the next sync notices, and the opening is written again.
        redis.start().wait()
        await state.sync([backend])
        assert state.is_available
        await asyncio.wait_for(_until_key(direct, key), 5)
        # Another replica adopts it from there.
        await peer.sync([other_copy := healthy_server(backend.url, "continuous_batching", ["m"])])
        assert other_copy.health.breaker.state() == "open"
        assert 55 < other_copy.health.breaker.seconds_until_retry() <= 60
        # A shorter opening written later never shortens the longer one.
        peer.attach([other_copy])
        other_copy.health.breaker.opened_until = None
        other_copy.health.breaker.open_for(5)
        await asyncio.sleep(0.2)
        stored_until = float(await direct.get(key))
        assert stored_until - (await _redis_time(direct)) > 50
        # A closing is not an opening of ours any more: nothing is replayed for it.
        backend.health.breaker.record_success()
        await asyncio.sleep(0.1)
        assert key not in state._own_openings
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert PASSWORD not in text and "***" in text
        assert any("reachable again" in r.getMessage() for r in caplog.records)
    finally:
        await state.stop()
        await peer.stop()
        await direct.aclose()
        redis.kill()


async def test_a_connection_that_died_idle_is_not_an_outage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    redis = _start_redis(tmp_path)
    backend = healthy_server("http://127.0.0.1:9", "continuous_batching", ["m"])
    state = SharedBreakerState(redis.url())
    caplog.set_level(logging.INFO, logger="client.balancing.shared_state")
    try:
        await state.sync([backend])  # a pooled connection now exists
        redis.kill()  # restarted between two calls: the pooled connection is dead
        redis.start().wait()
        await state.sync([backend])
        assert state.is_available
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        await state.stop()
        redis.kill()


async def _until_key(client: redis_asyncio.Redis, key: str) -> None:
    while await client.get(key) is None:
        await asyncio.sleep(0.02)


async def _redis_time(client: redis_asyncio.Redis) -> float:
    seconds, microseconds = await client.time()
    return seconds + microseconds / 1e6
