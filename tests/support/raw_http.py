"""HTTP over raw sockets, for what httpx refuses to send: broken headers, trickled bytes,
chunked uploads past a limit, connections held open and idle."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class RawAnswer:
    """What came back on a raw connection: the parsed status, headers and body (``status``
    0 when the server closed without a word) and how long until the connection closed."""

    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float
    data: bytes = b""  # everything that came, pipelined answers included

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.body)


def address_of(url: str) -> tuple[str, int]:
    """(host, port) of an ``http://host:port`` URL."""
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    return host, int(port)


def connect(url: str) -> socket.socket:
    """An open TCP connection to the server at ``url``."""
    sock = socket.create_connection(address_of(url), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def hold_trickling(url: str, stop: threading.Event, request_line: bytes = b"") -> None:
    """A slow client until ``stop``: ``request_line``, then a header byte every 0.2 s; it
    reconnects when the server hangs up on it (run it in a thread)."""
    while not stop.is_set():
        with connect(url) as sock:
            try:
                sock.sendall(request_line)
                while not stop.is_set():
                    sock.send(b"X")
                    stop.wait(0.2)
            except OSError:
                continue


@contextlib.contextmanager
def slow_clients(
    url: str, num_idle: int, num_trickling: int, request_line: bytes = b""
) -> Iterator[None]:
    """While the block runs, ``num_idle`` connections to ``url`` that send nothing and
    ``num_trickling`` clients in threads that :func:`hold_trickling` (after ``request_line``)."""
    idle = [connect(url) for _ in range(num_idle)]
    stop = threading.Event()
    args = (url, stop, request_line)
    trickles = [threading.Thread(target=hold_trickling, args=args) for _ in range(num_trickling)]
    for thread in trickles:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in trickles:
            thread.join(timeout=5)
        for sock in idle:
            sock.close()


def read_until_closed(sock: socket.socket, timeout_seconds: float) -> RawAnswer:
    """Read until the server closes the connection (or ``timeout_seconds`` pass: then the
    answer says so with ``seconds`` >= the timeout) and parse what came."""
    started = time.monotonic()
    sock.settimeout(timeout_seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    except ConnectionResetError:
        data += b""  # closed hard: what came before still counts
    seconds = time.monotonic() - started
    sock.close()
    return parse_answer(data, seconds)


def parse_answer(data: bytes, seconds: float) -> RawAnswer:
    """Split one HTTP/1.1 answer into status, headers and body."""
    if not data:
        return RawAnswer(0, {}, b"", seconds, data)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = body[: int(headers["content-length"])]
    return RawAnswer(int(lines[0].split()[1]), headers, body, seconds, data)


def exchange(url: str, request: bytes, timeout_seconds: float = 10.0) -> RawAnswer:
    """Send ``request`` whole and read the answer until the server closes."""
    sock = connect(url)
    try:
        sock.sendall(request)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may answer and close before the upload ends: read what it said
    return read_until_closed(sock, timeout_seconds)


def chunked_post(path: str, chunk: bytes, num_chunks: int) -> bytes:
    """A chunked POST (no Content-Length) of ``num_chunks`` times ``chunk``."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    one = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    return head + one * num_chunks + b"0\r\n\r\n"


def assert_error_shape(answer: RawAnswer, status: int) -> dict[str, Any]:
    """``answer`` is ``status`` in the project's JSON error shape; its error object."""
    assert answer.status == status, answer
    assert answer.headers.get("content-type", "").startswith("application/json"), answer
    error = answer.json()["error"]
    assert error["code"] == status and error["message"], error
    return error


def assert_refused(
    url: str, request: bytes, status: int, timeout_seconds: float = 10.0
) -> dict[str, Any]:
    """Send ``request`` to ``url``: the answer must be ``status`` in the error shape; returns
    the error object."""
    return assert_error_shape(exchange(url, request, timeout_seconds), status)
