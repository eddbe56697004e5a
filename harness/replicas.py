"""Gateway replicas sharing circuit state through Redis, over echo model servers: the
deployment of the chaos scenarios (``benchmarks/replicas_chaos.py``).

Every part is a real process on real sockets: one ``redis-server`` (with a password, so that
the logs can be checked for it), gateway replicas (``client_app.py``) whose
``shared_state_url`` points at it, and one process of echo servers (``harness.fake_server``):
an answer is the prompt's words reversed, streamed one word per event, so a wrong answer
(another request's, a truncated one) cannot pass for right. The backends:

- ``s1``, ``s2``: model ``m``, the load's model;
- ``f1``, ``f2``, ``f3``: models ``m-f1`` ... ``m-f3``, answering 500 to every request: two
  requests through a replica open their circuit there (a *breaker* opening);
- ``up``: an OpenAI-compatible upstream for model ``m-up`` with two jumper keys; ``sk-rest``
  gets 429 with Retry-After, so one request rests that key (a *cooldown*).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from harness.fake_server import fake_servers_args
from harness.network import BlackholeProxy, free_port
from harness.processes import Deployment
from harness.redis_server import RedisServer
from harness.waiting import async_wait_until

#: Redis' password: it must never show up in a replica's log.
REDIS_PASSWORD = "chaos-secret-pw-51"
#: Jumper keys of the upstream: the first always gets 429 (it rests), the second answers.
RESTING_KEY, GOOD_KEY = "sk-rest-chaos", "sk-good-chaos"
#: Retry-After of those 429s, and the breaker cooldown: longer than any scenario, so that
#: an opening never ends on its own while it is being measured.
REST_SECONDS = 120
#: Breaker settings of the replicas: two failures open a circuit.
BREAKER_FAILURES = 2
#: Bound of every wait on a condition the design promises (sync interval 0.5 s + Redis timeout
#: 0.5 s, plus a loaded 2-core CI machine): it bounds a hang, it is not a speed measurement.
CONVERGE_TIMEOUT_SECONDS = 5.0
START_TIMEOUT_SECONDS = 40.0
#: The echo backends and the load's servers among them.
BACKENDS = ("s1", "s2", "f1", "f2", "f3", "up")
LOCAL_BACKENDS = ("s1", "s2", "f1", "f2", "f3")


async def seconds_until(
    condition: Callable[[], Any], timeout: float, what: str, alive: Callable[[], None]
) -> float:
    """Poll ``condition()`` (sync or async) until truthy, every 20 ms; returns the seconds it
    took. ``alive`` raises when a process the wait depends on died."""
    start = time.monotonic()
    await async_wait_until(
        condition, timeout, message=what, alive=alive, ignoring=(httpx.HTTPError, OSError)
    )
    return time.monotonic() - start


class Replica:
    """One gateway replica: a process of the cluster's deployment."""

    def __init__(self, deployment: Deployment, name: str, port: int) -> None:
        self.deployment = deployment
        self.name = name
        self.port = port

    @property
    def url(self) -> str:
        """The replica's address."""
        return f"http://127.0.0.1:{self.port}"

    def check_alive(self) -> None:
        """Raise with the log's tail when the process exited."""
        self.deployment.check_alive(self.name)

    def log_text(self) -> str:
        """Everything the replica logged so far."""
        return self.deployment.log_text(self.name)


class Cluster:
    """Redis, the echo servers and the gateway replicas, in a temporary folder, stopped together."""

    def __init__(self, folder: Path, event_delay: float = 0.02) -> None:
        self.folder = folder
        self.event_delay = event_delay
        self.deployment = Deployment(folder, num_servers=0)
        self.redis = RedisServer(folder, password=REDIS_PASSWORD)
        self.ports = {name: free_port() for name in BACKENDS}
        self.replicas: dict[str, Replica] = {}
        self.proxies: list[BlackholeProxy] = []
        self.http = httpx.AsyncClient(timeout=5, trust_env=False)

    # addresses and names

    def url(self, backend: str) -> str:
        """The address of echo server ``backend``."""
        return f"http://127.0.0.1:{self.ports[backend]}"

    @property
    def resting_key_row(self) -> str:
        """The ``/backends`` name of the resting jumper key."""
        return f"openai[0]@{self.url('up')}/v1"

    # processes

    def start_echo(self) -> None:
        """Start the echo servers (one process)."""
        echo = {"kind": "continuous_batching", "max_model_len": 4096, "is_echo": True}
        echo.update(stream_delay_seconds=self.event_delay, retry_after_seconds=REST_SECONDS)
        echo.update(is_validating=False, fail_type="echo_error")
        specs: dict[int, dict[str, Any]] = {
            self.ports[name]: {**echo, "name": name, "model_id": "m"} for name in ("s1", "s2")
        }
        for name in ("f1", "f2", "f3"):
            specs[self.ports[name]] = {**echo, "name": name, "model_id": f"m-{name}"}
            specs[self.ports[name]]["fail_status"] = 500
        up = {"name": "up", "model_id": None, "fail_status_by_key": {RESTING_KEY: 429}}
        specs[self.ports["up"]] = {**echo, **up}
        self.deployment.spawn("echo", fake_servers_args("127.0.0.1", specs))

    async def wait_echo(self) -> None:
        """Wait until every echo server answers /health."""
        for backend in self.ports:
            url = f"{self.url(backend)}/health"
            await async_wait_until(
                lambda url=url: self.is_ok(url),
                START_TIMEOUT_SECONDS,
                interval=0.05,
                message="echo",
                ignoring=(httpx.HTTPError, OSError),
                alive=lambda: self.deployment.check_alive("echo"),
            )

    async def is_ok(self, url: str) -> bool:
        """Whether ``url`` answers GET with 200."""
        return (await self.http.get(url)).status_code == 200

    def start_replica(self, name: str, redis_port: int | None = None) -> Replica:
        """Start gateway replica ``name`` over all echo servers (Redis through ``redis_port``)."""
        jumper = {"base_url": f"{self.url('up')}/v1", "models": ["m-up"]}
        config = {
            "continuous_batching_server_urls": [self.url(b) for b in LOCAL_BACKENDS],
            "openai_jumper_configs": [{**jumper, "api_key": k} for k in (RESTING_KEY, GOOD_KEY)],
            "heart_beat_interval_seconds": 1.0,
            "circuit_breaker_failures": BREAKER_FAILURES,
            "circuit_breaker_cooldown_seconds": REST_SECONDS,
            "config_watch_interval_seconds": 0,
            "request_timeout_seconds": 30,
            "shared_state_url": self.redis.url(redis_port),
        }
        replica = Replica(self.deployment, name, free_port())
        self.deployment.start_gateway(config, name, replica.port, log_level=None)
        self.replicas[name] = replica
        return replica

    async def wait_replica(self, replica: Replica) -> None:
        """Wait until ``replica`` answers /health and routes model ``m``."""

        async def ready() -> bool:
            if (await self.http.get(f"{replica.url}/health")).status_code != 200:
                return False
            rows = (await self.http.get(f"{replica.url}/backends")).json()["backends"]
            healthy = {row["name"] for row in rows if row["is_healthy"]}
            return self.url("s1") in healthy and self.url("s2") in healthy

        await seconds_until(
            ready, START_TIMEOUT_SECONDS, f"replica {replica.name}", replica.check_alive
        )

    def kill_replica(self, name: str) -> None:
        """SIGKILL replica ``name``: its connections reset mid-answer, like a crash."""
        self.deployment.kill(name)

    def add_proxy(self) -> BlackholeProxy:
        """A black-holing proxy in front of Redis."""
        proxy = BlackholeProxy(self.redis.port).start()
        self.proxies.append(proxy)
        return proxy

    async def start(
        self, names: tuple[str, ...] = ("A", "B"), proxied: tuple[str, ...] = ()
    ) -> None:
        """Start Redis, the echo servers and the replicas ``names`` (``proxied``: via a proxy)."""
        self.redis.start()
        self.start_echo()
        await self.redis.wait_async()
        for name in names:
            self.start_replica(name, self.add_proxy().port if name in proxied else None)
        await self.wait_echo()
        for name in names:
            await self.wait_replica(self.replicas[name])

    async def stop(self) -> None:
        """Stop every process (SIGKILL those that do not exit in time) and the proxies."""
        await self.http.aclose()
        self.deployment.stop(timeout=10)
        self.redis.stop()
        for proxy in self.proxies:
            proxy.stop()

    # state

    async def circuit(self, replica: Replica, row_name: str) -> str:
        """The circuit state of backend ``row_name`` on ``replica``."""
        rows = (await self.http.get(f"{replica.url}/backends")).json()["backends"]
        return next(row["circuit"] for row in rows if row["name"] == row_name)

    async def ends_together(self, origin: Replica, other: Replica, row_name: str) -> bool:
        """True when ``other``'s copy of an opening ends within 2 s of ``origin``'s own, and
        neither outlasts the opening's length (``REST_SECONDS``, a first trip).

        (Adopted openings once lasted the machine's uptime longer, a unit mix-up, and the
        origin adopted its own inflated copy back: comparing the two alone missed it.)
        """

        async def left(replica: Replica) -> float:
            rows = (await self.http.get(f"{replica.url}/backends")).json()["backends"]
            return next(r["seconds_until_retry"] for r in rows if r["name"] == row_name)

        origin_left, other_left = await left(origin), await left(other)
        is_bounded = max(origin_left, other_left) <= REST_SECONDS + 1
        return is_bounded and abs(other_left - origin_left) <= 2.0

    async def num_requests(self, backend: str) -> int:
        """How many generation requests echo server ``backend`` received."""
        return (await self.http.get(f"{self.url(backend)}/_stats")).json()["num_requests"]

    async def open_breaker(self, replica: Replica, backend: str) -> float:
        """Open ``backend``'s circuit (f1, f2 or f3) on ``replica``; returns when (monotonic)."""
        body = {"model": f"m-{backend}", "prompt": "open it", "max_tokens": 4}
        for _ in range(BREAKER_FAILURES):
            response = await self.http.post(f"{replica.url}/v1/completions", json=body)
            assert response.status_code >= 500, response.text
        opened_at = time.monotonic()
        state = await self.circuit(replica, self.url(backend))
        assert state == "open", f"{backend} on {replica.name}: {state}"
        return opened_at

    async def rest_key(self, replica: Replica) -> float:
        """Rest the 429 jumper key on ``replica`` (its request moves on to the good key)."""
        body = {"model": "m-up", "messages": [{"role": "user", "content": "rest a key"}]}
        response = await self.http.post(f"{replica.url}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        rested_at = time.monotonic()
        assert await self.circuit(replica, self.resting_key_row) == "open"
        return rested_at

    async def seconds_until_open(
        self,
        replica: Replica,
        row_name: str,
        since: float,
        timeout: float = CONVERGE_TIMEOUT_SECONDS,
    ) -> float:
        """Seconds from ``since`` (monotonic) until ``replica`` shows ``row_name`` open."""

        async def is_open() -> bool:
            return await self.circuit(replica, row_name) == "open"

        what = f"{row_name} open on {replica.name}"
        await seconds_until(is_open, timeout, what, replica.check_alive)
        return time.monotonic() - since

    async def spread_seconds(
        self, origin: Replica, other: Replica, backend: str | None = None
    ) -> float:
        """Open ``backend``'s circuit (None: rest the jumper key) through ``origin``; the
        seconds until ``other`` shows it open too."""
        if backend is None:
            since, row = await self.rest_key(origin), self.resting_key_row
        else:
            since, row = await self.open_breaker(origin, backend), self.url(backend)
        return await self.seconds_until_open(other, row, since)

    async def stays_closed(self, replica: Replica, row_name: str, seconds: float) -> bool:
        """True when ``row_name`` is never open on ``replica`` for ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            replica.check_alive()
            if await self.circuit(replica, row_name) == "open":
                return False
            await asyncio.sleep(0.05)
        return True
