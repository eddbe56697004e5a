"""The gateway over real HTTP: routing by model, balancing, errors, late and dying servers."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import ServerThread, reserve_socket, start_gateway, stop_all, url_of
from harness.waiting import metric_value, wait_until
from protocol.health import LoadReport

GENERATE = {"prompt": "hi", "generation_config": {"max_new_tokens": 4}}


def _assert_error_shape(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"type", "message", "code"}
    assert error["code"] == status
    return error


@pytest.fixture(scope="module")
def _two_model_servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerThread, FakeServerSettings, FakeServerSettings]]:
    settings_a = FakeServerSettings(model_id="model-a", name="A")
    settings_b = FakeServerSettings(model_id="model-b", name="B")
    server_a, server_b = start_fake_server(settings_a), start_fake_server(settings_b)
    gateway = start_gateway(
        tmp_path_factory.mktemp("gateway"), [server_a.url, server_b.url], max_request_bytes=4000
    )
    yield gateway, settings_a, settings_b
    stop_all(gateway, server_a, server_b)


@pytest.fixture
def two_models(
    _two_model_servers: tuple[ServerThread, FakeServerSettings, FakeServerSettings],
) -> tuple[ServerThread, FakeServerSettings, FakeServerSettings]:
    """A gateway over two fake servers: A serves model-a, B serves model-b (shared, reset)."""
    for settings in _two_model_servers[1:]:
        settings.fail_status = None
        settings.requests.clear()
    return _two_model_servers


def test_routes_by_model_on_every_endpoint(two_models: tuple) -> None:
    gateway, settings_a, settings_b = two_models
    http = gateway.http
    for model, name in (("model-a", "A"), ("model-b", "B"), ("model-a", "A")):
        answer = http.post("/generate", json={**GENERATE, "model": model}).json()
        assert answer["choices"][0]["text"] == f"[{name}] w1 w2"
        answer = http.post("/v1/completions", json={"model": model, "prompt": "hi"}).json()
        assert answer["choices"][0]["text"].startswith(f"[{name}]")
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        answer = http.post("/v1/chat/completions", json=chat).json()
        assert answer["choices"][0]["message"]["content"].startswith(f"[{name}]")
    # No model (or ""): any healthy server.
    assert http.post("/generate", json=GENERATE).status_code == 200
    assert http.post("/generate", json={**GENERATE, "model": ""}).status_code == 200
    assert len(settings_a.requests) + len(settings_b.requests) == 11
    # The original body went through unchanged, unknown-but-harmless fields included.
    body = {"model": "model-b", "prompt": "hi", "vendor_extra": {"x": 1}}
    assert http.post("/v1/completions", json=body).status_code == 200
    assert settings_b.requests[-1] == ("/v1/completions", body)


def test_models_health_backends_and_metrics(two_models: tuple) -> None:
    gateway, _, _ = two_models
    http = gateway.http
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [card["id"] for card in models["data"]] == ["model-a", "model-b"]
    assert models["data"][0]["max_model_len"] == 2048
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["kind"] == "gateway"
    assert health["num_healthy_backends"] == 2
    table = http.get("/backends").json()["backends"]
    assert [row["model_ids"] for row in table] == [["model-a"], ["model-b"]]
    assert all(row["is_healthy"] and row["num_in_flight"] == 0 for row in table)
    url_a = table[0]["url"]
    ok_sample = f'gateway_requests_total{{backend="{url_a}",endpoint="/generate",outcome="ok"}}'
    rejected_sample = (
        'gateway_requests_total{backend="none",endpoint="/generate",outcome="rejected"}'
    )
    before = http.get("/metrics").text
    http.post("/generate", json={**GENERATE, "model": "model-a"})
    http.post("/generate", json={**GENERATE, "model": "nope"})
    metrics = http.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert metric_value(text, ok_sample) == metric_value(before, ok_sample) + 1
    assert metric_value(text, rejected_sample) == metric_value(before, rejected_sample) + 1
    in_flight_sample = f'gateway_backend_in_flight{{backend="{url_a}",kind="static_batching"}}'
    assert f"{in_flight_sample} 0.0" in text
    assert "gateway_request_duration_seconds_bucket" in text


def test_request_ids_end_to_end(two_models: tuple, caplog: pytest.LogCaptureFixture) -> None:
    gateway, settings_a, _ = two_models
    http = gateway.http
    body = {**GENERATE, "model": "model-a"}
    with caplog.at_level(logging.INFO, logger="client.forwarding.attempt"):
        answer = http.post("/generate", json=body, headers={"X-Request-ID": "trace-42.a"})
    # The caller's id reaches the server and comes back; the gateway logs it with the backend.
    assert answer.headers["x-request-id"] == "trace-42.a"
    assert settings_a.request_ids[-1] == "trace-42.a"
    line = next(r.getMessage() for r in caplog.records if "trace-42.a" in r.getMessage())
    assert "/generate" in line and ":ok" in line
    assert gateway_url_of(http, "model-a") in line
    # Without one (or with one unfit for logs and headers) the gateway makes one up.
    for headers in ({}, {"X-Request-ID": "has spaces"}, {"X-Request-ID": "x" * 200}):
        answer = http.post("/generate", json={**body, "stream": True}, headers=headers)
        request_id = answer.headers["x-request-id"]
        assert len(request_id) == 32 and request_id == settings_a.request_ids[-1]
    # Refused requests carry one too.
    refused = http.post("/generate", json={**GENERATE, "model": "nope"})
    assert refused.status_code == 404 and len(refused.headers["x-request-id"]) == 32


def gateway_url_of(http: httpx.Client, model: str) -> str:
    """The URL of the backend serving ``model`` (from the gateway's status table)."""
    table = http.get("/backends").json()["backends"]
    return next(row["url"] for row in table if model in row["model_ids"])


def test_unknown_model_is_404_listing_models(two_models: tuple) -> None:
    gateway, _, _ = two_models
    response = gateway.http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    error = _assert_error_shape(response, 404)
    assert "gpt-9" in error["message"]
    assert "'model-a'" in error["message"] and "'model-b'" in error["message"]
    assert error["param"] == "model"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/generate",
            {"prompt": "x", "generation_config": {"max_new_tokens": 0}},
            "generation_config.max_new_tokens",
        ),
        ("/generate", {"model": "model-a"}, ""),  # neither prompt nor messages
        ("/v1/chat/completions", {"model": "model-a"}, "messages"),
        ("/v1/completions", {"model": "model-a", "prompt": "x", "n": 0}, "n"),
    ],
)
def test_bad_body_gets_the_servers_400_naming_the_field(
    two_models: tuple, path: str, body: dict, param: str
) -> None:
    gateway, settings_a, settings_b = two_models
    response = gateway.http.post(f"{path}", json=body)
    error = _assert_error_shape(response, 400)
    assert error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param and param in error["message"]
    else:
        assert "prompt" in error["message"] and "messages" in error["message"]
    # The gateway forwarded the body as it came: the server answered for itself.
    received = settings_a.requests + settings_b.requests
    assert [json.dumps(sent) for _, sent in received] == [json.dumps(body)]


def test_invalid_json_and_oversized_body(two_models: tuple) -> None:
    gateway, _, _ = two_models
    http = gateway.http
    response = http.post("/generate", content=b"{not json", headers={"content-type": "x"})
    assert "not valid JSON" in _assert_error_shape(response, 400)["message"]
    response = http.post("/generate", json=["a list"])
    assert "JSON object" in _assert_error_shape(response, 400)["message"]
    response = http.post("/generate", json={"prompt": "x" * 5000})
    assert "4000 bytes" in _assert_error_shape(response, 413)["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    _assert_error_shape(http.post("/generate", content=chunked()), 413)


def test_upstream_errors_pass_through_unchanged(two_models: tuple) -> None:
    gateway, settings_a, _ = two_models
    settings_a.fail_status = 429
    for stream in (False, True):
        body = {**GENERATE, "model": "model-a", "stream": stream}
        response = gateway.http.post("/generate", json=body)
        assert response.status_code == 429
        assert response.headers["retry-after"] == "7"
        assert response.json()["error"]["type"] == "fake_error"


def test_no_server_up_is_503_with_retry_after(tmp_path: Path) -> None:
    sock = reserve_socket()  # bound, never listening: connection refused
    gateway = start_gateway(tmp_path, [url_of(sock)])
    try:
        for path, body in (("/generate", GENERATE), ("/v1/completions", {"prompt": "x"})):
            response = gateway.http.post(f"{path}", json=body)
            error = _assert_error_shape(response, 503)
            assert error["type"] == "overloaded_error"
            assert int(response.headers["retry-after"]) >= 1
        assert gateway.http.get("/v1/models").json()["data"] == []
        assert gateway.http.get("/health").json()["num_healthy_backends"] == 0
    finally:
        gateway.stop()
        sock.close()


def test_server_started_after_the_gateway_is_found(tmp_path: Path) -> None:
    sock = reserve_socket()
    gateway = start_gateway(tmp_path, [url_of(sock)])  # heartbeat 60 s: only lazy refresh
    server = None
    try:
        body = {**GENERATE, "model": "late-model"}
        assert gateway.http.post("/generate", json=body).status_code == 503
        server = start_fake_server(FakeServerSettings(model_id="late-model", name="L"), sock)
        # No heartbeat comes: a request finds the server through the lazy refresh, once the
        # refresh throttle (LAZY_REFRESH_MIN_INTERVAL_SECONDS) has passed since the last one.
        response = wait_until(
            lambda: gateway.http.post("/generate", json=body),
            5,
            interval=0.05,
            until=lambda response: response.status_code == 200,
            message="a request to find the late server",
        )
        assert response.json()["choices"][0]["text"].startswith("[L]")
    finally:
        stop_all(gateway, server)


def test_server_dying_is_taken_out_of_rotation(tmp_path: Path) -> None:
    settings = FakeServerSettings(model_id="m", name="D")
    server = start_fake_server(settings)
    gateway = start_gateway(tmp_path, [server.url])
    try:
        body = {**GENERATE, "model": "m"}
        assert gateway.http.post("/generate", json=body).status_code == 200
        server.stop()
        response = gateway.http.post("/generate", json=body)
        _assert_error_shape(response, 503)  # connection refused: never reached a server
        assert "retry-after" in response.headers
        row = gateway.http.get("/backends").json()["backends"][0]
        assert not row["is_healthy"] and row["num_in_flight"] == 0
        # The model is remembered: "try later" (503), not "no such model" (404).
        _assert_error_shape(gateway.http.post("/generate", json=body), 503)
    finally:
        gateway.stop()


def test_cb_servers_are_preferred_over_sb(tmp_path: Path) -> None:
    cb_settings = FakeServerSettings(model_id="m", name="CB", kind="continuous_batching")
    sb_settings = FakeServerSettings(model_id="m", name="SB")
    cb, sb = start_fake_server(cb_settings), start_fake_server(sb_settings)
    gateway = start_gateway(tmp_path, [sb.url], [cb.url])
    try:
        for _ in range(3):
            answer = gateway.http.post("/generate", json={**GENERATE, "model": "m"}).json()
            assert answer["choices"][0]["text"].startswith("[CB]")
        assert sb_settings.requests == []
    finally:
        stop_all(gateway, cb, sb)


def test_least_outstanding_work_balancing(tmp_path: Path) -> None:
    gate = threading.Event()
    settings_a = FakeServerSettings(
        model_id="m", name="A", load=LoadReport(num_waiting=3, num_running=1), stream_gate=gate
    )
    settings_b = FakeServerSettings(model_id="m", name="B", stream_gate=gate)
    server_a, server_b = start_fake_server(settings_a), start_fake_server(settings_b)
    gateway = start_gateway(tmp_path, [server_a.url, server_b.url])
    http = gateway.http
    streams = []
    try:
        # A reported 4 busy, B 0: three held streams all go to B (its in-flight count 0, 1, 2).
        for _ in range(3):
            response = http.send(
                http.build_request("POST", "/generate", json={**GENERATE, "stream": True}),
                stream=True,
            )
            lines = response.iter_lines()  # kept: dropping it would close the stream
            streams.append((response, lines))
            assert "[B]" in next(lines)
        table = http.get("/backends").json()["backends"]
        assert [row["num_in_flight"] for row in table] == [0, 3]
        # A now reports idle: 0 < 3 in flight at B.
        settings_a.load = LoadReport()
        gateway.run(gateway.app.state.gateway.registry.refresh())
        answer = http.post("/generate", json={**GENERATE, "model": "m"}).json()
        assert answer["choices"][0]["text"].startswith("[A]")
        # Equal load: requests take turns.
        gate.set()
        for response, lines in streams:
            assert [line for line in lines if line][-1] == "data: [DONE]"
            response.close()
        # Their leases end once the gateway has seen the streams end.
        wait_until(
            lambda: [row["num_in_flight"] for row in http.get("/backends").json()["backends"]],
            3,
            until=lambda counts: counts == [0, 0],
            message="the finished streams' leases to be released",
        )
        names = [
            http.post("/generate", json=GENERATE).json()["choices"][0]["text"][:3] for _ in range(4)
        ]
        assert sorted(names) == ["[A]", "[A]", "[B]", "[B]"]
    finally:
        gate.set()
        for response, _ in streams:
            response.close()
        stop_all(gateway, server_a, server_b)


def test_heartbeat_finds_a_late_server_without_requests(tmp_path: Path) -> None:
    sock = reserve_socket()
    gateway = start_gateway(tmp_path, [url_of(sock)], heart_beat_interval_seconds=0.1)
    server = None
    try:
        assert gateway.http.get("/health").json()["num_healthy_backends"] == 0
        server = start_fake_server(FakeServerSettings(model_id="m"), sock)
        num_healthy = lambda: gateway.http.get("/health").json()["num_healthy_backends"]  # noqa: E731
        wait_until(
            num_healthy, 3, until=lambda n: n >= 1, message="the heartbeat to find the server"
        )
        server.stop()
        wait_until(
            num_healthy,
            3,
            until=lambda n: n == 0,
            message="the heartbeat to notice the server left",
        )
    finally:
        stop_all(gateway, server)


def test_a_client_hanging_up_mid_upload_is_an_info_line(
    two_models: tuple, caplog: pytest.LogCaptureFixture
) -> None:
    gateway, _, _ = two_models
    host, port = gateway.url.removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"prompt": "'
            )
        wait_until(
            lambda: any("client went away" in r.getMessage() for r in caplog.records),
            10,
            message="the gateway's log line about the client that went away",
        )
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_stream_read_to_done_counts_ok_even_if_the_caller_hangs_up_at_once(
    two_models: tuple,
) -> None:
    gateway, settings_a, _ = two_models
    settings_a.linger_after_done_seconds = 2.0  # the server's end of body comes late
    url_a = gateway_url_of(gateway.http, "model-a")
    ok = 'gateway_request_duration_seconds_count{endpoint="/generate",outcome="ok"}'
    cancelled = 'gateway_request_duration_seconds_count{endpoint="/generate",outcome="cancelled"}'
    before = gateway.http.get("/metrics").text
    try:
        body = {**GENERATE, "model": "model-a", "stream": True}
        with gateway.http.stream("POST", "/generate", json=body) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    break  # and hang up, like the openai SDK
        wait_until(
            lambda: (
                metric_value(gateway.http.get("/metrics").text, ok) == metric_value(before, ok) + 1
            ),
            10,
            message=f"the stream on {url_a} counted as ok",
        )
        assert metric_value(gateway.http.get("/metrics").text, cancelled) == metric_value(
            before, cancelled
        )
    finally:
        settings_a.linger_after_done_seconds = 0.0
