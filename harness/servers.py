"""Real ASGI apps in background threads of the test process: any app, and the real gateway."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
from fastapi import FastAPI

from harness.waiting import wait_until
from utils.serving import uvicorn_options

T = TypeVar("T")

_config_ids = itertools.count()


def reserve_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A bound but not yet listening socket (``port`` 0: a free one): its port refuses
    connections until served."""
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose proto
    # says TCP, and without it every keep-alive answer waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def url_of(sock: socket.socket) -> str:
    """The http address of a bound socket (127.0.0.1, or a test host's own address)."""
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"


class ServerThread:
    """A real uvicorn server for ``app`` in a background thread (own event loop)."""

    def __init__(
        self, app: FastAPI, sock: socket.socket | None = None, http_parser: str = "httptools"
    ) -> None:
        self.app = app
        self.sock = sock or reserve_socket()
        self.url = url_of(self.sock)
        # Served as the apps are deployed: the hardened protocol, with the app's limits.
        config = uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=1,
            **uvicorn_options(app, http_parser),  # type: ignore[arg-type]
        )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._http: httpx.Client | None = None

    @property
    def http(self) -> httpx.Client:
        """A keep-alive client for this server (closed by :func:`stop_all`)."""
        if self._http is None:
            self._http = httpx.Client(base_url=self.url, timeout=5)
        return self._http

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve(sockets=[self.sock])

    def start(self, timeout_seconds: float = 10.0) -> ServerThread:
        """Start serving and wait until the server accepts connections."""
        self._thread.start()

        def started() -> bool:
            if not self.server.started and not self._thread.is_alive():
                raise RuntimeError(f"server for {self.url} exited before it started")
            return self.server.started

        wait_until(
            started, timeout_seconds, interval=0.005, message=f"the server for {self.url} to start"
        )
        return self

    def stop(self) -> None:
        """Ask the server to exit and wait for its thread."""
        stop_all(self)

    def run(self, coro: Coroutine[Any, Any, T], timeout_seconds: float = 10.0) -> T:
        """Run ``coro`` on the server's event loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_seconds)


def stop_all(*servers: ServerThread | None) -> None:
    """Stop servers in parallel (each takes a few tenths of a second to shut down)."""
    running = [server for server in servers if server is not None]
    for server in running:
        server.server.should_exit = True
    for server in running:
        server._thread.join(timeout=10)
        if server._http is not None:
            server._http.close()
            server._http = None


#: An ASGI application (what uvicorn serves).
ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Any]


def serve_by_port(host: str, apps: dict[int, ASGIApp]) -> None:
    """Serve ``apps[port]`` on each port of ``host`` in this process until it is terminated.

    One uvicorn over all the ports (one event loop, one SIGTERM), each request going to its
    port's app: many cheap servers (e.g. fakes) cost one process.
    """

    async def by_port(scope: dict, receive: Any, send: Any) -> None:
        await apps[scope["server"][1]](scope, receive, send)

    sockets = [reserve_socket(host, port) for port in apps]
    config = uvicorn.Config(
        by_port, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
    )
    asyncio.run(uvicorn.Server(config).serve(sockets=sockets))


def start_gateway(
    tmp_path: Path,
    static_batching_server_urls: list[str] | None = None,
    continuous_batching_server_urls: list[str] | None = None,
    http_parser: str = "httptools",
    **overrides: Any,
) -> ServerThread:
    """A running gateway (``client_app.build_app``) over the given servers.

    The heartbeat defaults to 60 s so that tests decide when health is refreshed.
    """
    from client_app import build_app

    config = {
        "continuous_batching_server_urls": continuous_batching_server_urls or [],
        "static_batching_server_urls": static_batching_server_urls or [],
        "heart_beat_interval_seconds": 60,
        "health_timeout_seconds": 1,
        "connect_timeout_seconds": 1,
        **overrides,
    }
    path = tmp_path / f"client_config_{next(_config_ids)}.json"
    path.write_text(json.dumps(config))
    return ServerThread(build_app(str(path)), http_parser=http_parser).start()


def served(app: FastAPI, timeout_seconds: float = 10.0) -> Iterator[ServerThread]:
    """Serve ``app`` in a thread, yield the server, stop it when resumed: a fixture's body
    (``yield from served(app)``)."""
    server = ServerThread(app).start(timeout_seconds)
    try:
        yield server
    finally:
        server.stop()


def gateway_served(tmp_path: Path, **config: Any) -> Iterator[ServerThread]:
    """:func:`start_gateway` (same arguments), yielded and stopped: a fixture's body."""
    gateway = start_gateway(tmp_path, **config)
    try:
        yield gateway
    finally:
        gateway.stop()
