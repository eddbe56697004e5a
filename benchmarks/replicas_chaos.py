"""Two gateway replicas sharing circuit state through Redis, under chaos (issue #26, item 5).

Every part is a real process on real sockets: one ``redis-server`` (with a password, so the
logs can be checked for it), two gateway replicas (``client_app.py``) whose ``shared_state_url``
points at it, and one process of cheap "echo" model servers (this file, ``--serve-echo``): an
answer is the prompt's words reversed, streamed one word per event, so a wrong answer (another
request's, a truncated one) cannot pass for right. The backends:

- ``s1``, ``s2``: model ``m``, the load's model;
- ``f1``, ``f2``, ``f3``: models ``m-f1`` ... ``m-f3``, answering 500 to every request: two
  requests through a replica open their circuit there (a *breaker* opening);
- ``up``: an OpenAI-compatible upstream for model ``m-up`` with two jumper keys; ``sk-rest``
  gets 429 with Retry-After, so one request rests that key (a *cooldown*).

Scenarios (each on a fresh cluster):

- ``redis``: under load, Redis is SIGKILLed and restarted on its port (empty). The replicas go
  on with their own state; an opening made during the outage reaches the other replica once
  Redis is back, and openings made after the restart converge as before.
- ``kill``: under concurrent load spread over both replicas, replica A is SIGKILLed. The load's
  client behaves like a load balancer: a request that got no byte from a replica (connection
  refused, or closed before the status line) is sent to the other one. Then A is restarted and
  must adopt the openings the other replica holds.
- ``cutoff``: replica A reaches Redis through a TCP proxy that starts black-holing (accepts,
  forwards nothing: every Redis call of A times out). A serves on with local state and logs one
  warning per outage; after the proxy forwards again both replicas converge.

Convergence is measured from the moment the request that opened a circuit on one replica
returned to the moment the other replica's ``/backends`` shows the circuit open (polled every
20 ms); a replica that starts is measured from its first healthy ``/health``.

Run: ``python benchmarks/replicas_chaos.py [--scenario all] [--json PATH]``; the tests in
``tests/gateway/test_replicas_chaos.py`` run the same scenarios with smaller loads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make the project importable
    sys.path.insert(0, str(REPO_ROOT))

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
REQUEST_TIMEOUT_SECONDS = 20.0
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, num_chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else "(no log)"


async def wait_for(
    condition: Callable[[], Any],
    timeout: float,
    what: str,
    alive: Callable[[], None] | None = None,
    interval: float = 0.02,
) -> float:
    """Poll ``condition()`` (sync or async) until truthy; returns the seconds it took.

    ``alive()`` runs before every poll and raises when a process the wait depends on died, so
    that a crash fails at once with its log instead of running into the timeout.
    """
    start = time.monotonic()
    while True:
        if alive is not None:
            alive()
        try:
            value = condition()
            if asyncio.iscoroutine(value):
                value = await value
        except (httpx.HTTPError, OSError):
            value = None
        if value:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


# -- the echo model servers ------------------------------------------------------------------


def expected_text(prompt: str) -> str:
    """An echo server's answer to ``prompt``: its words reversed."""
    return " ".join(reversed(prompt.split()))


def build_echo_app(specs: dict[int, dict[str, Any]], event_delay: float) -> Any:
    """One app for several echo servers: each listening port is one server with its own state.

    ``specs[port]``: ``model`` (None: any model, as an OpenAI upstream), ``fail_status`` (every
    generation request gets it), ``fail_keys`` (bearer key -> status, with Retry-After).
    ``GET /_stats`` gives the port's generation request count.
    """
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from protocol.health import HealthResponse
    from utils.sse import SSE_HEADERS, encode_done, encode_event

    counts = dict.fromkeys(specs, 0)
    ids = itertools.count()

    def spec_of(request: Request) -> tuple[int, dict[str, Any]]:
        port = request.scope["server"][1]
        return port, specs[port]

    def error(status: int, message: str) -> JSONResponse:
        body = {"error": {"type": "echo_error", "message": message, "code": status}}
        return JSONResponse(body, status_code=status, headers={"Retry-After": str(REST_SECONDS)})

    async def health(request: Request) -> Response:
        _, spec = spec_of(request)
        report = HealthResponse(kind="continuous_batching", model=spec["model"], max_model_len=4096)
        return JSONResponse(report.model_dump())

    async def stats(request: Request) -> Response:
        port, _ = spec_of(request)
        return JSONResponse({"num_requests": counts[port]})

    async def generate(request: Request) -> Response:
        port, spec = spec_of(request)
        counts[port] += 1
        body = json.loads(await request.body())
        if spec.get("fail_status"):
            return error(spec["fail_status"], "failing (on purpose)")
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        if key in spec.get("fail_keys", {}):
            return error(spec["fail_keys"][key], "key rests (on purpose)")
        if spec["model"] is not None and body.get("model") not in (None, spec["model"]):
            return error(404, f"model {body.get('model')!r} is not served here")
        path = request.url.path
        messages = body.get("messages")
        prompt = messages[-1]["content"] if messages else body.get("prompt", "")
        words = expected_text(prompt).split()
        pieces = [w if i == 0 else f" {w}" for i, w in enumerate(words)]
        model, rid = body.get("model") or spec["model"], f"echo-{next(ids)}"
        usage = {"prompt_tokens": len(words), "completion_tokens": len(words)}
        usage["total_tokens"] = 2 * len(words)

        def chunk(piece: str, finish: str | None) -> dict[str, Any]:
            if path == "/v1/chat/completions":
                choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}}
                kind = "chat.completion.chunk"
            else:
                choice, kind = {"index": 0, "text": piece}, "text_completion"
            choice["finish_reason"] = finish
            return {"id": rid, "object": kind, "created": 1, "model": model, "choices": [choice]}

        if body.get("stream"):

            async def events() -> Any:
                for i, piece in enumerate(pieces):
                    await asyncio.sleep(event_delay)
                    yield encode_event(chunk(piece, "stop" if i == len(pieces) - 1 else None))
                yield encode_done()

            return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
        await asyncio.sleep(event_delay * len(pieces))
        text = "".join(pieces)
        if path == "/v1/chat/completions":
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            kind = "chat.completion"
        else:
            choice, kind = {"index": 0, "text": text, "finish_reason": "stop"}, "text_completion"
        answer = {"id": rid, "object": kind, "created": 1, "model": model, "choices": [choice]}
        return JSONResponse({**answer, "usage": usage})

    routes = [Route("/health", health), Route("/_stats", stats)]
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        routes.append(Route(path, generate, methods=["POST"]))
    return Starlette(routes=routes)


def serve_echo(specs: dict[int, dict[str, Any]], event_delay: float) -> None:
    """Serve the echo servers of ``specs`` in this process until it is terminated."""
    import uvicorn

    sockets = []
    for port in specs:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sockets.append(sock)
    app = build_echo_app(specs, event_delay)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    asyncio.run(server.serve(sockets=sockets))


# -- a TCP proxy that can black-hole ---------------------------------------------------------


class BlackholeProxy:
    """A TCP proxy (own thread and loop) in front of one port that can stop forwarding.

    Cut, it keeps accepting and holding connections but forwards nothing either way: the
    harshest way to lose Redis, since every call waits for its timeout instead of failing
    fast. Restored, it closes the connections it held so that clients reconnect, and forwards
    again.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.is_cut = False
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="blackhole-proxy")
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> BlackholeProxy:
        """Listen on a free port (``self.port``)."""
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if self.is_cut:  # accepted, and then nothing: hold it until restored
                while not writer.is_closing() and await reader.read(65536):
                    pass
                return
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            self._writers.add(up_writer)
            await asyncio.gather(
                self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
            )
        except OSError:
            pass
        finally:
            self._close_all([writer])

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if not self.is_cut:  # cut: swallowed
                    writer.write(data)
                    await writer.drain()
        finally:
            self._close_all([writer])

    def _close_all(self, writers: list[asyncio.StreamWriter]) -> None:
        for writer in writers:
            self._writers.discard(writer)
            writer.close()

    def cut(self) -> None:
        """Stop forwarding (connections stay open, silent)."""
        self.is_cut = True

    def restore(self) -> None:
        """Close what was held during the cut and forward again."""

        def reopen() -> None:
            self._close_all(list(self._writers))
            self.is_cut = False

        done = threading.Event()
        self._loop.call_soon_threadsafe(lambda: (reopen(), done.set()))
        done.wait(5)

    def stop(self) -> None:
        """Close everything and end the thread."""

        def shutdown() -> None:
            self._close_all(list(self._writers))
            if self._server is not None:
                self._server.close()
            self._loop.stop()

        self._loop.call_soon_threadsafe(shutdown)
        self._thread.join(5)


# -- the cluster -----------------------------------------------------------------------------


@dataclass
class Replica:
    """One gateway replica process."""

    name: str
    port: int
    log: Path
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        """The replica's address."""
        return f"http://127.0.0.1:{self.port}"

    def check_alive(self) -> None:
        """Raise with the log's tail when the process exited."""
        if self.process.poll() is not None:
            raise RuntimeError(
                f"replica {self.name} exited ({self.process.returncode}):\n{_tail(self.log)}"
            )

    def log_text(self) -> str:
        """Everything the replica logged so far."""
        return self.log.read_text(errors="replace")


class Cluster:
    """Redis, the echo servers and the gateway replicas, in a temporary folder, stopped together."""

    def __init__(self, folder: Path, event_delay: float = 0.02) -> None:
        self.folder = folder
        self.event_delay = event_delay
        self.redis_port = free_port()
        self.redis: subprocess.Popen[bytes] | None = None
        self.echo: subprocess.Popen[bytes] | None = None
        self.ports = {name: free_port() for name in ("s1", "s2", "f1", "f2", "f3", "up")}
        self.replicas: dict[str, Replica] = {}
        self.proxies: list[BlackholeProxy] = []
        self.http = httpx.AsyncClient(timeout=5, trust_env=False)

    # addresses and names

    def url(self, backend: str) -> str:
        """The address of echo server ``backend``."""
        return f"http://127.0.0.1:{self.ports[backend]}"

    def redis_url(self, port: int | None = None) -> str:
        """The shared-state URL (through ``port``, e.g. a proxy's; default Redis' own)."""
        return f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port or self.redis_port}/0"

    @property
    def resting_key_row(self) -> str:
        """The ``/backends`` name of the resting jumper key."""
        return f"openai[0]@{self.url('up')}/v1"

    # processes

    def start_redis(self) -> None:
        """Start redis-server on its port (again, after a kill: it comes back empty)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is missing (make test-tools)")
        args = [binary, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--requirepass", REDIS_PASSWORD, "--dir", str(self.folder)]
        self.redis = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill_redis(self) -> None:
        """SIGKILL Redis: its connections reset, its keys are gone."""
        assert self.redis is not None
        self.redis.send_signal(signal.SIGKILL)
        self.redis.wait(10)

    async def wait_redis(self) -> None:
        """Wait until Redis answers PING (with the password)."""

        def pong() -> bool:
            assert self.redis is not None
            if self.redis.poll() is not None:
                raise RuntimeError(f"redis-server exited ({self.redis.returncode})")
            with socket.create_connection(("127.0.0.1", self.redis_port), timeout=1) as conn:
                conn.sendall(f"AUTH {REDIS_PASSWORD}\r\nPING\r\n".encode())
                data = b""
                while b"PONG" not in data and len(data) < 64:
                    chunk = conn.recv(64)
                    if not chunk:
                        break
                    data += chunk
                return b"PONG" in data

        await wait_for(pong, 10, "redis-server", interval=0.05)

    def start_echo(self) -> None:
        """Start the echo servers (one process)."""
        specs = {
            self.ports["s1"]: {"model": "m"},
            self.ports["s2"]: {"model": "m"},
            self.ports["f1"]: {"model": "m-f1", "fail_status": 500},
            self.ports["f2"]: {"model": "m-f2", "fail_status": 500},
            self.ports["f3"]: {"model": "m-f3", "fail_status": 500},
            self.ports["up"]: {"model": None, "fail_keys": {RESTING_KEY: 429}},
        }
        log = open(self.folder / "echo.log", "ab")  # noqa: SIM115 (owned by the process)
        args = [__file__, "--serve-echo", json.dumps(specs), "--event-delay", str(self.event_delay)]
        self.echo = subprocess.Popen(
            [sys.executable, *args], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    async def wait_echo(self) -> None:
        """Wait until every echo server answers /health."""

        def alive() -> None:
            assert self.echo is not None
            if self.echo.poll() is not None:
                raise RuntimeError(f"echo servers exited:\n{_tail(self.folder / 'echo.log')}")

        for backend in self.ports:
            url = f"{self.url(backend)}/health"
            await wait_for(
                lambda url=url: self._is_ok(url), START_TIMEOUT_SECONDS, "echo", alive, 0.05
            )

    async def _is_ok(self, url: str) -> bool:
        return (await self.http.get(url)).status_code == 200

    def start_replica(self, name: str, redis_port: int | None = None) -> Replica:
        """Start gateway replica ``name`` over all echo servers (Redis through ``redis_port``)."""
        jumper = {"base_url": f"{self.url('up')}/v1", "models": ["m-up"]}
        config = {
            "continuous_batching_server_urls": [
                self.url(b) for b in ("s1", "s2", "f1", "f2", "f3")
            ],
            "openai_jumper_configs": [{**jumper, "api_key": k} for k in (RESTING_KEY, GOOD_KEY)],
            "heart_beat_interval_seconds": 1.0,
            "circuit_breaker_failures": BREAKER_FAILURES,
            "circuit_breaker_cooldown_seconds": REST_SECONDS,
            "config_watch_interval_seconds": 0,
            "request_timeout_seconds": 30,
            "shared_state_url": self.redis_url(redis_port),
        }
        path = self.folder / f"{name}.json"
        path.write_text(json.dumps(config))
        port, log_path = free_port(), self.folder / f"{name}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "client_app.py", "--config", str(path), "--port", str(port)],
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        replica = Replica(name, port, log_path, process)
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

        await wait_for(ready, START_TIMEOUT_SECONDS, f"replica {replica.name}", replica.check_alive)

    def kill_replica(self, name: str) -> None:
        """SIGKILL replica ``name``: its connections reset mid-answer, like a crash."""
        replica = self.replicas[name]
        replica.process.send_signal(signal.SIGKILL)
        replica.process.wait(10)

    def add_proxy(self) -> BlackholeProxy:
        """A black-holing proxy in front of Redis."""
        proxy = BlackholeProxy(self.redis_port).start()
        self.proxies.append(proxy)
        return proxy

    async def start(
        self, names: tuple[str, ...] = ("A", "B"), proxied: tuple[str, ...] = ()
    ) -> None:
        """Start Redis, the echo servers and the replicas ``names`` (``proxied``: via a proxy)."""
        self.start_redis()
        self.start_echo()
        await self.wait_redis()
        for name in names:
            self.start_replica(name, self.add_proxy().port if name in proxied else None)
        await self.wait_echo()
        for name in names:
            await self.wait_replica(self.replicas[name])

    async def stop(self) -> None:
        """Stop every process (SIGKILL those that do not exit in time) and the proxies."""
        await self.http.aclose()
        processes = [r.process for r in self.replicas.values()] + [self.redis, self.echo]
        for process in processes:
            if process is not None and process.poll() is None:
                process.terminate()
        for process in processes:
            if process is None:
                continue
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
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
        model = f"m-{backend}"
        body = {"model": model, "prompt": "open it", "max_tokens": 4}
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

        await wait_for(is_open, timeout, f"{row_name} open on {replica.name}", replica.check_alive)
        return time.monotonic() - since

    async def stays_closed(self, replica: Replica, row_name: str, seconds: float) -> bool:
        """True when ``row_name`` is never open on ``replica`` for ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            replica.check_alive()
            if await self.circuit(replica, row_name) == "open":
                return False
            await asyncio.sleep(0.05)
        return True


# -- the load, through a client that retries like a load balancer ----------------------------


@dataclass
class LoadReport:
    """What the load's callers saw."""

    num_sent: int = 0
    num_ok: int = 0
    #: Answers that came back whole but with text other than the request's own.
    num_wrong: int = 0
    #: Requests that got no byte from any replica (refused or closed everywhere), or an error
    #: status: requests lost that had not started. Goal: 0.
    num_lost_not_started: int = 0
    #: Requests whose answer had begun (status line received) when their replica died: lost
    #: in flight, the client saw a partial answer.
    num_lost_in_flight: int = 0
    #: Requests a replica refused (connection refused): sent to the other one.
    num_retried_refused: int = 0
    #: Requests sent to a replica that closed without a byte: sent to the other one.
    num_retried_no_byte: int = 0
    #: Requests that took longer than REQUEST_TIMEOUT_SECONDS.
    num_hung: int = 0
    max_latency_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class ReplicaClient:
    """Sends the load over the replicas, the way a load balancer in front of them would.

    Requests ``4k .. 4k+3`` prefer replica ``k % n``; a replica that gives no byte (connection
    refused, or closed before the status line) gets the request again on the next replica. Once the
    status line has come, the request belongs to that replica: if it dies, the request is lost
    in flight (a non-idempotent POST that started is not replayed).
    """

    def __init__(self, urls: list[str], report: LoadReport) -> None:
        self.urls = urls
        self.report = report
        self.http = httpx.AsyncClient(timeout=REQUEST_TIMEOUT_SECONDS, trust_env=False)
        #: Requests in flight per replica URL (the kill is timed by them).
        self.in_flight = dict.fromkeys(urls, 0)

    async def aclose(self) -> None:
        """Close the connections."""
        await self.http.aclose()

    @staticmethod
    def request_of(index: int) -> tuple[str, dict[str, Any], str]:
        """Request ``index``: (path, body, expected text); four kinds in turn."""
        words = [f"r{index}"] + [WORDS[(index + k) % len(WORDS)] for k in range(5)]
        prompt = " ".join(words)
        is_chat, is_stream = index % 4 >= 2, index % 2 == 1
        body: dict[str, Any] = {"model": "m", "max_tokens": 16, "stream": is_stream}
        if is_chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/v1/completions"
        return path, body, expected_text(prompt)

    async def send(self, index: int) -> None:
        """Send request ``index`` and count what happened to it."""
        path, body, expected = self.request_of(index)
        report = self.report
        report.num_sent += 1
        start = time.monotonic()
        # Four requests in a row (the four kinds) per replica, so each replica gets every kind.
        first = index // 4
        order = [self.urls[(first + k) % len(self.urls)] for k in range(len(self.urls))]
        try:
            outcome = await asyncio.wait_for(
                self._send(order, path, body, expected), REQUEST_TIMEOUT_SECONDS
            )
        except TimeoutError:
            outcome = "hung"
        report.max_latency_seconds = max(report.max_latency_seconds, time.monotonic() - start)
        if outcome == "ok":
            report.num_ok += 1
        elif outcome == "wrong":
            report.num_wrong += 1
        elif outcome == "in_flight":
            report.num_lost_in_flight += 1
        elif outcome == "hung":
            report.num_hung += 1
        else:
            report.num_lost_not_started += 1
            if len(report.errors) < 10:
                report.errors.append(f"request {index}: {outcome}")

    async def _send(self, order: list[str], path: str, body: dict[str, Any], expected: str) -> str:
        last_error = "no replica"
        for attempt, url in enumerate(order):
            self.in_flight[url] += 1
            try:
                async with self.http.stream("POST", url + path, json=body) as response:
                    # The status line came: from here on the request is this replica's.
                    try:
                        if response.status_code != 200:
                            await response.aread()
                            return f"HTTP {response.status_code}: {response.text[:200]}"
                        text = await self._read_text(response, bool(body["stream"]), path)
                    except (httpx.HTTPError, ValueError, KeyError):
                        return "in_flight"
                    return "ok" if text == expected else "wrong"
            except httpx.ConnectError as exc:
                last_error = f"refused: {exc}"
                if attempt + 1 < len(order):
                    self.report.num_retried_refused += 1
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                last_error = f"no byte: {type(exc).__name__}: {exc}"
                if attempt + 1 < len(order):
                    self.report.num_retried_no_byte += 1
            finally:
                self.in_flight[url] -= 1
        return last_error

    @staticmethod
    async def _read_text(response: httpx.Response, is_stream: bool, path: str) -> str | None:
        """The answer's text; None for an answer that is not whole (no [DONE], error event)."""
        is_chat = path == "/v1/chat/completions"
        if not is_stream:
            choice = json.loads(await response.aread())["choices"][0]
            return choice["message"]["content"] if is_chat else choice["text"]
        pieces, is_done = [], False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                is_done = True
                continue
            event = json.loads(data)
            if "error" in event:
                return None
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") if is_chat else choice["text"]
                pieces.append(piece or "")
        return "".join(pieces) if is_done else None


async def run_load(
    client: ReplicaClient,
    concurrency: int,
    num_requests: int | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Send ``num_requests`` requests (or until ``stop`` is set), ``concurrency`` at a time."""
    counter = itertools.count()

    async def worker() -> None:
        while True:
            if stop is not None and stop.is_set():
                return
            index = next(counter)
            if num_requests is not None and index >= num_requests:
                return
            await client.send(index)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


# -- the scenarios ---------------------------------------------------------------------------


@dataclass
class ScenarioReport:
    """One scenario's figures."""

    scenario: str
    load: LoadReport
    #: Seconds for breaker / cooldown state to reach the other replica, by what was measured.
    convergence_seconds: dict[str, float] = field(default_factory=dict)
    #: Facts checked on the way (True: as designed), e.g. "B kept local state during outage".
    checks: dict[str, bool] = field(default_factory=dict)
    #: "shared state ... unreachable" warnings per replica.
    num_warnings: dict[str, int] = field(default_factory=dict)
    #: Whether the Redis password appeared in any replica's log.
    is_secret_logged: bool = False
    #: Requests the client had in flight on the replica it SIGKILLed (kill scenario).
    num_in_flight_at_kill: int | None = None
    duration_seconds: float = 0.0


def _count_warnings(cluster: Cluster) -> dict[str, int]:
    return {
        name: replica.log_text().count("unreachable")
        for name, replica in sorted(cluster.replicas.items())
    }


def _is_secret_logged(cluster: Cluster) -> bool:
    return any(REDIS_PASSWORD in replica.log_text() for replica in cluster.replicas.values())


async def _background(
    client: ReplicaClient, concurrency: int
) -> tuple[asyncio.Task, asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_load(client, concurrency, stop=stop))
    return task, stop


async def scenario_redis(
    folder: Path, concurrency: int = 8, outage_seconds: float = 2.0
) -> ScenarioReport:
    """Redis SIGKILLed and restarted under load."""
    started = time.monotonic()
    cluster = Cluster(folder)
    report = ScenarioReport("redis", LoadReport())
    try:
        await cluster.start()
        a, b = cluster.replicas["A"], cluster.replicas["B"]
        client = ReplicaClient([a.url, b.url], report.load)
        task, stop = await _background(client, concurrency)
        try:
            since = await cluster.open_breaker(a, "f1")
            report.convergence_seconds["breaker A->B, steady"] = await cluster.seconds_until_open(
                b, cluster.url("f1"), since
            )
            report.checks["B's copy of the breaker ends with A's"] = await cluster.ends_together(
                a, b, cluster.url("f1")
            )
            cluster.kill_redis()
            for replica in (a, b):  # each notices on its own (its next sync round)
                await wait_for(
                    lambda r=replica: "unreachable" in r.log_text(),
                    CONVERGE_TIMEOUT_SECONDS,
                    f"{replica.name}'s warning",
                    replica.check_alive,
                )
            # During the outage an opening on A stays A's own: B routes by its own state.
            await cluster.open_breaker(a, "f2")
            report.checks["outage: B keeps its own state"] = await cluster.stays_closed(
                b, cluster.url("f2"), outage_seconds
            )
            cluster.start_redis()
            await cluster.wait_redis()
            restarted_at = time.monotonic()
            # The outage's opening reaches B once Redis is back (A writes it again).
            report.convergence_seconds[
                "breaker A->B made during outage, from restart"
            ] = await cluster.seconds_until_open(b, cluster.url("f2"), restarted_at)
            # New openings after the restart converge as before.
            since = await cluster.open_breaker(a, "f3")
            report.convergence_seconds[
                "breaker A->B after restart"
            ] = await cluster.seconds_until_open(b, cluster.url("f3"), since)
            since = await cluster.rest_key(a)
            report.convergence_seconds[
                "cooldown A->B after restart"
            ] = await cluster.seconds_until_open(b, cluster.resting_key_row, since)
            for replica in (a, b):
                await wait_for(
                    lambda r=replica: "reachable again" in r.log_text(),
                    CONVERGE_TIMEOUT_SECONDS,
                    f"{replica.name} reconnected",
                    replica.check_alive,
                )
            await asyncio.sleep(0.5)  # a little load after the restart too
        finally:
            stop.set()
            await task
            await client.aclose()
        report.num_warnings = _count_warnings(cluster)
        report.is_secret_logged = _is_secret_logged(cluster)
    finally:
        await cluster.stop()
    report.duration_seconds = time.monotonic() - started
    return report


async def scenario_kill(
    folder: Path, num_requests: int = 240, concurrency: int = 16, kill_after: int = 80
) -> ScenarioReport:
    """Replica A SIGKILLed under load; the clients retry on B; then A restarts."""
    started = time.monotonic()
    cluster = Cluster(folder)
    report = ScenarioReport("kill", LoadReport())
    try:
        await cluster.start()
        a, b = cluster.replicas["A"], cluster.replicas["B"]
        # Openings made on B before the kill (A adopts them; so must A's successor).
        since = await cluster.open_breaker(b, "f1")
        report.convergence_seconds["breaker B->A, steady"] = await cluster.seconds_until_open(
            a, cluster.url("f1"), since
        )
        since = await cluster.rest_key(b)
        report.convergence_seconds["cooldown B->A, steady"] = await cluster.seconds_until_open(
            a, cluster.resting_key_row, since
        )
        report.checks["A's copy of the cooldown ends with B's"] = await cluster.ends_together(
            b, a, cluster.resting_key_row
        )
        client = ReplicaClient([a.url, b.url], report.load)
        load = asyncio.create_task(run_load(client, concurrency, num_requests))
        try:
            await wait_for(
                lambda: report.load.num_ok >= kill_after,
                60,
                "the load's first answers",
                a.check_alive,
            )
            report.checks["requests in flight on A at the kill"] = client.in_flight[a.url] > 0
            in_flight_on_a = report.num_in_flight_at_kill = client.in_flight[a.url]
            cluster.kill_replica("A")
            await load
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
            await client.aclose()
        report.checks["lost in flight <= in flight on A at the kill"] = (
            report.load.num_lost_in_flight <= in_flight_on_a
        )
        # The restarted replica (a new process) adopts B's openings from Redis.
        restarted = cluster.start_replica("A2")
        await wait_for(
            lambda: cluster._is_ok(f"{restarted.url}/health"),
            START_TIMEOUT_SECONDS,
            "replica A2",
            restarted.check_alive,
        )
        since = time.monotonic()
        report.convergence_seconds["breaker, restarted replica"] = await cluster.seconds_until_open(
            restarted, cluster.url("f1"), since
        )
        report.convergence_seconds[
            "cooldown, restarted replica"
        ] = await cluster.seconds_until_open(restarted, cluster.resting_key_row, since)
        # ...and keeps traffic away from them without trying them itself.
        before = await cluster.num_requests("f1")
        body = {"model": "m-f1", "prompt": "stay away", "max_tokens": 4}
        status = (await cluster.http.post(f"{restarted.url}/v1/completions", json=body)).status_code
        report.checks["restarted replica keeps traffic off f1"] = (
            status == 503 and await cluster.num_requests("f1") == before
        )
        report.num_warnings = _count_warnings(cluster)
        report.is_secret_logged = _is_secret_logged(cluster)
    finally:
        await cluster.stop()
    report.duration_seconds = time.monotonic() - started
    return report


async def scenario_cutoff(
    folder: Path, concurrency: int = 8, outage_seconds: float = 2.0
) -> ScenarioReport:
    """Replica A cut off from Redis (black-holed) under load, twice, then reconnected."""
    started = time.monotonic()
    cluster = Cluster(folder)
    report = ScenarioReport("cutoff", LoadReport())
    try:
        await cluster.start(proxied=("A",))
        a, b = cluster.replicas["A"], cluster.replicas["B"]
        proxy = cluster.proxies[0]
        client = ReplicaClient([a.url, b.url], report.load)
        task, stop = await _background(client, concurrency)
        try:
            proxy.cut()
            await wait_for(
                lambda: "unreachable" in a.log_text(),
                CONVERGE_TIMEOUT_SECONDS,
                "A's warning",
                a.check_alive,
            )
            # Each side's openings during the cut stay its own.
            await cluster.open_breaker(b, "f1")
            await cluster.open_breaker(a, "f2")
            await cluster.rest_key(a)
            closed_on_a = await cluster.stays_closed(a, cluster.url("f1"), outage_seconds)
            report.checks["cut: A keeps its own state"] = closed_on_a
            report.checks["cut: B keeps its own state"] = await cluster.stays_closed(
                b, cluster.url("f2"), 0.2
            )
            proxy.restore()
            restored_at = time.monotonic()
            # A reads B's opening; B gets A's openings made while it was cut off.
            report.convergence_seconds[
                "breaker B->A after reconnect"
            ] = await cluster.seconds_until_open(a, cluster.url("f1"), restored_at)
            report.convergence_seconds[
                "breaker A->B after reconnect"
            ] = await cluster.seconds_until_open(b, cluster.url("f2"), restored_at)
            report.convergence_seconds[
                "cooldown A->B after reconnect"
            ] = await cluster.seconds_until_open(b, cluster.resting_key_row, restored_at)
            report.checks[
                "B's copy of A's outage cooldown ends with A's"
            ] = await cluster.ends_together(a, b, cluster.resting_key_row)
            await wait_for(
                lambda: "reachable again" in a.log_text(),
                CONVERGE_TIMEOUT_SECONDS,
                "A reconnected",
                a.check_alive,
            )
            # A second outage: a second warning (one per outage, not one per failed call).
            proxy.cut()
            await wait_for(
                lambda: a.log_text().count("unreachable") >= 2,
                CONVERGE_TIMEOUT_SECONDS,
                "A's second warning",
                a.check_alive,
            )
            await asyncio.sleep(outage_seconds / 2)
            proxy.restore()
            await wait_for(
                lambda: a.log_text().count("reachable again") >= 2,
                CONVERGE_TIMEOUT_SECONDS,
                "A reconnected again",
                a.check_alive,
            )
        finally:
            stop.set()
            await task
            await client.aclose()
        report.num_warnings = _count_warnings(cluster)
        report.is_secret_logged = _is_secret_logged(cluster)
    finally:
        await cluster.stop()
    report.duration_seconds = time.monotonic() - started
    return report


SCENARIOS = {"redis": scenario_redis, "kill": scenario_kill, "cutoff": scenario_cutoff}


def format_reports(reports: list[ScenarioReport]) -> str:
    """The reports as text tables (one row per scenario, then the convergence figures)."""
    lines = [
        "| scenario | sent | ok | wrong | lost, not started | lost in flight | retried (refused "
        "/ no byte) | hung | max latency s | outage warnings | password in logs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        load = report.load
        warnings = " ".join(f"{name}:{n}" for name, n in report.num_warnings.items())
        lines.append(
            f"| {report.scenario} | {load.num_sent} | {load.num_ok} | {load.num_wrong} | "
            f"{load.num_lost_not_started} | {load.num_lost_in_flight} | "
            f"{load.num_retried_refused} / {load.num_retried_no_byte} | {load.num_hung} | "
            f"{load.max_latency_seconds:.2f} | {warnings} | "
            f"{'yes' if report.is_secret_logged else 'no'} |"
        )
    lines += ["", "| scenario | state converged | seconds |", "|---|---|---|"]
    for report in reports:
        for what, seconds in report.convergence_seconds.items():
            lines.append(f"| {report.scenario} | {what} | {seconds:.2f} |")
    lines += ["", "| scenario | check | holds |", "|---|---|---|"]
    for report in reports:
        for what, holds in report.checks.items():
            lines.append(f"| {report.scenario} | {what} | {'yes' if holds else 'NO'} |")
    for report in reports:
        if report.num_in_flight_at_kill is not None:
            lines.append(
                f"{report.scenario}: {report.num_in_flight_at_kill} requests in flight on the "
                f"killed replica: {report.load.num_lost_in_flight} streams had begun (lost), "
                "the others had answered or had no byte yet (sent to the other replica)"
            )
        for error in report.load.errors:
            lines.append(f"{report.scenario}: {error}")
    return "\n".join(lines)


async def run_all(names: list[str], folder: Path) -> list[ScenarioReport]:
    """Run the scenarios ``names`` one after the other, each in a subfolder of ``folder``."""
    reports = []
    for name in names:
        sub = folder / name
        sub.mkdir(parents=True, exist_ok=True)
        reports.append(await SCENARIOS[name](sub))
    return reports


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--json", type=Path, help="also write the reports here")
    parser.add_argument("--keep-logs", type=Path, help="folder for the processes' logs")
    parser.add_argument("--serve-echo", help=argparse.SUPPRESS)  # the echo servers' process
    parser.add_argument("--event-delay", type=float, default=0.02, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_echo:
        specs = {int(port): spec for port, spec in json.loads(args.serve_echo).items()}
        serve_echo(specs, args.event_delay)
        return 0
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    with tempfile.TemporaryDirectory(prefix="replicas-chaos-") as tmp:
        folder = args.keep_logs or Path(tmp)
        reports = asyncio.run(run_all(names, folder))
    print(format_reports(reports))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=2) + "\n")
    is_clean = all(
        r.load.num_lost_not_started == 0
        and r.load.num_wrong == 0
        and r.load.num_hung == 0
        and all(r.checks.values())
        and not r.is_secret_logged
        for r in reports
    )
    return 0 if is_clean else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
