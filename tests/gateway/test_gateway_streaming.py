"""Streams through the gateway: chunk by chunk, caller disconnects, upstream breaking off.

Also the non-streaming counterpart of a disconnect: a caller giving up on a long answer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import ServerThread, start_gateway, stop_all
from harness.waiting import wait_until

STREAM = {"model": "m", "prompt": "hi", "stream": True}


@pytest.fixture
def gateway_and_fake(tmp_path: Path) -> Iterator[tuple[ServerThread, FakeServerSettings]]:
    """A gateway over one fake server (model "m") whose streams wait at a gate."""
    settings = FakeServerSettings(model_id="m", name="S", stream_gate=threading.Event())
    server = start_fake_server(settings)
    gateway = start_gateway(tmp_path, [server.url])
    yield gateway, settings
    assert settings.stream_gate is not None
    settings.stream_gate.set()
    stop_all(gateway, server)


def _count_reaches(count: Callable[[], int], expected: int, what: str) -> None:
    wait_until(count, 3, interval=0.01, until=lambda n: n == expected, message=what)


def _wait_idle(gateway: ServerThread) -> None:
    """Wait until the gateway holds no request (leases are released after the answer ends)."""
    _count_reaches(lambda: _in_flight(gateway), 0, "no request in flight at the gateway")


def _data(lines: Iterator[str]) -> Iterator[str]:
    """The ``data`` payloads of an SSE line stream."""
    for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def _in_flight(gateway: ServerThread) -> int:
    return gateway.http.get("/backends").json()["backends"][0]["num_in_flight"]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_stream_passes_through_chunk_by_chunk(
    gateway_and_fake: tuple[ServerThread, FakeServerSettings], path: str
) -> None:
    gateway, settings = gateway_and_fake
    assert settings.stream_gate is not None
    body = dict(STREAM)
    if path == "/v1/chat/completions":
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with gateway.http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _data(response.iter_lines())
        first = json.loads(next(events))
        # The fake server is holding the rest of its stream: the first event got here alone.
        assert not settings.stream_gate.is_set() and settings.num_streams_completed == 0
        assert _in_flight(gateway) == 1
        settings.stream_gate.set()
        rest = list(events)
    assert rest[-1] == "[DONE]"
    chunks = [first] + [json.loads(data) for data in rest[:-1]]
    if path == "/v1/chat/completions":
        text = "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks)
    else:
        text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert text == settings.text()
    _wait_idle(gateway)
    assert settings.num_streams_completed == 1


def test_caller_disconnect_aborts_the_upstream_stream(
    gateway_and_fake: tuple[ServerThread, FakeServerSettings],
) -> None:
    gateway, settings = gateway_and_fake
    with gateway.http.stream("POST", "/generate", json=STREAM) as response:
        events = _data(response.iter_lines())  # kept alive: dropping it closes the stream
        assert json.loads(next(events))["choices"][0]["text"] == "[S]"
        assert _in_flight(gateway) == 1
    # Closing the caller's connection must close the upstream one: the server sees it go.
    _count_reaches(lambda: settings.num_streams_cancelled, 1, "the upstream stream's cancellation")
    assert settings.num_streams_completed == 0
    _wait_idle(gateway)
    metrics = gateway.http.get("/metrics").text
    assert 'endpoint="/generate",outcome="cancelled"} 1.0' in metrics


def test_upstream_breaking_off_ends_the_stream_with_an_error_event(tmp_path: Path) -> None:
    settings = FakeServerSettings(model_id="m", break_stream_after=2, num_stream_events=4)
    server = start_fake_server(settings)
    gateway = start_gateway(tmp_path, [server.url])
    try:
        with gateway.http.stream("POST", "/generate", json=STREAM) as response:
            assert response.status_code == 200
            events = list(_data(response.iter_lines()))
        assert len(events) == 3  # two chunks, then the error in the one error shape
        error = json.loads(events[-1])["error"]
        assert error["code"] == 502 and error["type"] == "upstream_error"
        _wait_idle(gateway)
    finally:
        stop_all(gateway, server)


def test_many_concurrent_streams_are_counted_and_released(tmp_path: Path) -> None:
    settings = FakeServerSettings(model_id="m", num_stream_events=5, stream_delay_seconds=0.02)
    server = start_fake_server(settings)
    gateway = start_gateway(tmp_path, [server.url])
    results: list[str] = []

    def one_stream() -> None:
        with gateway.http.stream("POST", "/v1/completions", json=STREAM) as response:
            results.append(list(_data(response.iter_lines()))[-1])

    try:
        threads = [threading.Thread(target=one_stream) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert results == ["[DONE]"] * 8
        assert settings.num_streams_completed == 8
        _wait_idle(gateway)
    finally:
        stop_all(gateway, server)


def test_caller_giving_up_on_a_non_streaming_answer_aborts_it(tmp_path: Path) -> None:
    settings = FakeServerSettings(model_id="m", answer_gate=threading.Event())
    server = start_fake_server(settings)
    gateway = start_gateway(tmp_path, [server.url])
    try:
        with pytest.raises(httpx.ReadTimeout, match="timed out"):
            gateway.http.post("/generate", json={"model": "m", "prompt": "hi"}, timeout=0.3)
        _count_reaches(
            lambda: settings.num_answers_abandoned, 1, "the upstream answer's abandonment"
        )
        _wait_idle(gateway)
        metrics = gateway.http.get("/metrics").text
        assert 'endpoint="/generate",outcome="cancelled"} 1.0' in metrics
        assert settings.answer_gate is not None
        settings.answer_gate.set()
        assert gateway.http.post("/generate", json={"model": "m", "prompt": "hi"}).is_success
    finally:
        stop_all(gateway, server)
