"""Clumsy and hostile clients of a real CB server over raw sockets (issue #15, points 4 and 7):
the server answers in the JSON error shape, refuses an oversized chunked upload with 413
after reading up to its limit, and closes slow and idle connections within its timeouts
while it keeps generating for everyone else."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.servers import ServerThread
from server.common.app import create_server_app
from server.common.service import ServingSettings
from server.continuous_batching.async_engine import AsyncEngine
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import MODEL_ID, engine_config
from tests.support.raw_http import (
    assert_error_shape,
    assert_refused,
    chunked_post,
    connect,
    read_until_closed,
    slow_clients,
)
from utils.connection_limits import ConnectionLimits

#: The trickling clients' request line (then header bytes, one at a time).
POST_LINE = b"POST /generate HTTP/1.1\r\n"
LIMITS = ConnectionLimits(
    header_timeout_seconds=1.0,
    body_idle_timeout_seconds=0.6,
    body_timeout_seconds=1.5,
    keep_alive_timeout_seconds=0.5,
)


@pytest.fixture(scope="module")
def cb_server(default_model_path: Path, cb_runner: ModelRunner) -> Iterator[ServerThread]:
    """A CB server with short connection limits and a 4000-byte body limit."""
    engine = LLMEngine(engine_config(default_model_path, num_blocks=64), runner=cb_runner)
    settings = ServingSettings(
        served_model_names=[MODEL_ID],
        default_max_new_tokens=4,
        max_request_bytes=4000,
        connection_limits=LIMITS,
    )
    server = ServerThread(create_server_app(AsyncEngine(engine, MODEL_ID), settings))
    yield server.start(timeout_seconds=60)
    server.stop()


def test_bad_framing_answers_in_the_error_shape(cb_server: ServerThread) -> None:
    big = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (4 << 20) + b"\r\n\r\n"
    assert_refused(cb_server.url, big, 431)
    bad_length = b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 1e3\r\n\r\n{}"
    assert_refused(cb_server.url, bad_length, 400)


def test_chunked_upload_over_the_limit_is_413(cb_server: ServerThread) -> None:
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        request = chunked_post(path, b" " * 65536, 32)
        error = assert_refused(cb_server.url, request, 413, timeout_seconds=5)
        assert "4000" in error["message"]


def test_slow_headers_and_bodies_get_408(cb_server: ServerThread) -> None:
    started = time.monotonic()
    slow_headers = connect(cb_server.url)
    slow_headers.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\n")
    stalled_body = connect(cb_server.url)
    stalled_body.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 50\r\n\r\n{")
    idle = connect(cb_server.url)
    assert_error_shape(read_until_closed(slow_headers, timeout_seconds=5), 408)
    assert_error_shape(read_until_closed(stalled_body, timeout_seconds=5), 408)
    assert read_until_closed(idle, timeout_seconds=5).status == 0
    assert time.monotonic() - started < 3


def test_generation_goes_on_while_slow_clients_are_held(cb_server: ServerThread) -> None:
    with slow_clients(cb_server.url, 50, 3, POST_LINE):
        for _ in range(3):
            response = cb_server.http.post(
                "/v1/completions",
                json={
                    "model": MODEL_ID,
                    "prompt": "The capital of France is",
                    "max_tokens": 4,
                    # Sampled at the default temperature, EOS may come first.
                    "ignore_eos": True,
                },
            )
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4
