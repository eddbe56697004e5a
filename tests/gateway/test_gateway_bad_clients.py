"""Clumsy and hostile clients of the gateway over raw sockets (issue #15, points 4 and 7):
unparseable requests answer in the JSON error shape, oversized headers 431, an oversized
chunked upload 413 and a closed connection; slow and idle connections are closed within
their timeouts while normal requests are served; past the connection cap, JSON 503."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import ServerThread, start_gateway, stop_all
from tests.support.raw_http import (
    assert_error_shape,
    assert_refused,
    chunked_post,
    connect,
    exchange,
    read_until_closed,
    slow_clients,
)

#: Short limits so that every timeout is seen within a second or two.
LIMITS = {
    "header_timeout_seconds": 1.0,
    "body_idle_timeout_seconds": 0.6,
    "body_timeout_seconds": 1.5,
    "keep_alive_timeout_seconds": 0.5,
    "max_request_bytes": 4000,
}
GENERATE = {"model": "fake-model", "prompt": "hi", "generation_config": {"max_new_tokens": 4}}


@pytest.fixture(scope="module", params=["httptools", "h11"])
def gateway(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerThread]:
    """A gateway with short connection limits over one fake model server, served by the
    hardened protocol of each HTTP parser (httptools is what deployments use)."""
    server = start_fake_server(FakeServerSettings())
    gateway = start_gateway(
        tmp_path_factory.mktemp("gateway"), [server.url], http_parser=request.param, **LIMITS
    )
    yield gateway
    stop_all(gateway, server)


def test_oversized_header_is_431_in_the_error_shape(gateway: ServerThread) -> None:
    big = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (4 << 20) + b"\r\n\r\n"
    error = assert_refused(gateway.url, big, 431)
    assert "65536" in error["message"]
    # Many ordinary headers that add up past the limit, sent in one piece, too.
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(1000))
    request = b"GET /health HTTP/1.1\r\nHost: t\r\n" + many + b"\r\n"
    assert_refused(gateway.url, request, 431)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n{}",
        b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\n{}",
        b"GET / HTTP/1.1\r\nHost t\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS hello on the plain port
    ],
)
def test_unparseable_requests_are_400_in_the_error_shape(
    gateway: ServerThread, request_bytes: bytes
) -> None:
    error = assert_refused(gateway.url, request_bytes, 400)
    assert error["type"] == "invalid_request_error"


def test_chunked_upload_over_the_limit_is_413_and_closed(gateway: ServerThread) -> None:
    # 2 MB in 64 KiB chunks without Content-Length against a 4000-byte limit.
    request = chunked_post("/generate", b"x" * 65536, 32)
    answer = exchange(gateway.url, request, timeout_seconds=5)
    assert_error_shape(answer, 413)
    # Refused and closed: the rest of the upload is not read for nothing.
    assert answer.seconds < 3, answer.seconds


def test_slow_headers_get_408_and_idle_connections_close(gateway: ServerThread) -> None:
    slow = connect(gateway.url)
    for byte in b"GET /health HTT":  # a byte every 0.1 s: never complete within 1 s
        try:
            slow.send(bytes([byte]))
        except OSError:
            break
        time.sleep(0.1)
    answer = read_until_closed(slow, timeout_seconds=5)
    assert_error_shape(answer, 408)
    started = time.monotonic()
    idle = connect(gateway.url)  # connected, says nothing: closed quietly
    assert read_until_closed(idle, timeout_seconds=5).status == 0
    assert time.monotonic() - started < 2.5


def test_slow_and_stalled_bodies_get_408(gateway: ServerThread) -> None:
    head = b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n"
    stalled = connect(gateway.url)
    stalled.sendall(head + b'{"mo')
    assert_error_shape(read_until_closed(stalled, timeout_seconds=5), 408)
    trickle = connect(gateway.url)  # never silent for long, but far too slow in all
    trickle.sendall(head)
    started = time.monotonic()
    while time.monotonic() - started < 5:
        trickle.send(b" ")
        if select.select([trickle], [], [], 0.2)[0]:
            break  # the server spoke
    assert time.monotonic() - started < 2.5
    assert_error_shape(read_until_closed(trickle, timeout_seconds=5), 408)


def test_idle_keep_alive_connection_is_closed(gateway: ServerThread) -> None:
    sock = connect(gateway.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    answer = read_until_closed(sock, timeout_seconds=5)
    assert answer.status == 200
    assert answer.seconds < 2, answer.seconds  # keep-alive of 0.5 s


def test_pipelined_requests_are_all_answered(gateway: ServerThread) -> None:
    one = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    last = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    sock = connect(gateway.url)
    sock.sendall(one * 3 + last)
    answer = read_until_closed(sock, timeout_seconds=5)
    assert answer.data.count(b"HTTP/1.1 200 OK") == 4


def test_normal_requests_are_served_while_slow_clients_are_held(gateway: ServerThread) -> None:
    with slow_clients(gateway.url, 100, 5):
        for _ in range(10):
            started = time.monotonic()
            response = gateway.http.post("/generate", json=GENERATE)
            assert response.status_code == 200, response.text
            assert time.monotonic() - started < 1


@pytest.mark.parametrize("http_parser", ["httptools", "h11"])
def test_connections_past_the_cap_get_503_with_retry_after(
    tmp_path: Path, http_parser: str
) -> None:
    gateway = start_gateway(
        tmp_path, http_parser=http_parser, max_connections=5, header_timeout_seconds=30
    )
    held: list[socket.socket] = []
    try:
        held = [connect(gateway.url) for _ in range(5)]
        answer = exchange(gateway.url, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        error = assert_error_shape(answer, 503)
        assert answer.headers["retry-after"] == "1"
        assert error["type"] == "overloaded_error"
    finally:
        for sock in held:
            sock.close()
        stop_all(gateway)
