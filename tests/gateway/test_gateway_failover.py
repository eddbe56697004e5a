"""Failover over real HTTP: retries before the first byte, never after it, the circuit breaker,
heartbeat mark-down and mark-up, caller auth and config reload."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from harness.fake_server import FakeServerSettings, start_fake_server
from harness.processes import Deployment
from harness.servers import ServerThread, start_gateway, stop_all
from harness.waiting import metric_value, wait_until

CHAT_PATH = "/v1/chat/completions"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _sse_payloads(text: str) -> list[Any]:
    """The events' data, JSON-decoded (the closing ``[DONE]`` as it is)."""
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(item) if item != "[DONE]" else item for item in data]


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Callable[..., tuple[ServerThread, list[FakeServerSettings]]]]:
    """Factory: a gateway over fake servers A, B, ... all serving model "m" (CB kind)."""
    started: list[ServerThread] = []

    def make(num_servers: int = 2, **config: Any) -> tuple[ServerThread, list[FakeServerSettings]]:
        settings = [
            FakeServerSettings(model_id="m", name=chr(ord("A") + i), kind="continuous_batching")
            for i in range(num_servers)
        ]
        servers = [start_fake_server(s) for s in settings]
        for setting, server in zip(settings, servers, strict=True):
            setting.server = server  # type: ignore[attr-defined]
        config.setdefault("retry_backoff_seconds", 0.01)
        gateway = start_gateway(
            tmp_path, continuous_batching_server_urls=[s.url for s in servers], **config
        )
        started.extend([gateway, *servers])
        return gateway, settings

    yield make
    stop_all(*started)


def test_a_request_failing_alone_is_neither_retried_nor_held_against_its_server(
    pair: Callable,
) -> None:
    gateway, (a, b) = pair(balancing_policy="round_robin", circuit_breaker_failures=2)
    a.fail_status, a.fail_type = 500, "request_failed_error"
    statuses = [gateway.http.post("/v1/chat/completions", json=CHAT).status_code for _ in range(6)]
    # Every other request goes to A first and gets A's answer: not retried on B...
    assert statuses.count(500) == 3 and statuses.count(200) == 3
    assert len(a.requests) == 3 and len(b.requests) == 3
    # ... and A stays in rotation: its circuit counts no failure.
    row = gateway.http.get("/backends").json()["backends"][0]
    assert row["circuit"] == "closed" and row["num_failures"] == 0


def test_after_a_failover_each_backend_is_timed_from_its_own_attempt(pair: Callable) -> None:
    """The second backend's latency starts when the request was sent to it, not when the
    gateway received it: it is not charged the first backend's slow failure."""
    gateway, (a, b) = pair(balancing_policy="round_robin", circuit_breaker_failures=10)
    a.fail_status, a.fail_delay_seconds = 500, 0.6
    for _ in range(2):  # round robin: at least one goes to A first and fails over to B
        assert gateway.http.post(CHAT_PATH, json=CHAT).status_code == 200
    num_failovers = len(a.requests)
    assert num_failovers >= 1 and len(b.requests) == 2
    metrics = gateway.http.get("/metrics").text
    latency = "gateway_backend_latency_seconds"
    a_url, b_url = a.server.url, b.server.url  # type: ignore[attr-defined]
    assert metric_value(metrics, f'{latency}_count{{backend="{a_url}"}}') == num_failovers
    assert metric_value(metrics, f'{latency}_sum{{backend="{a_url}"}}') >= 0.6 * num_failovers
    assert metric_value(metrics, f'{latency}_count{{backend="{b_url}"}}') == 2
    # B answered both at once: well under A's 0.6 s, although a request waited that long.
    assert metric_value(metrics, f'{latency}_sum{{backend="{b_url}"}}') < 0.5
    # The whole request, as the caller saw it, does include the failed attempt.
    duration = 'gateway_request_duration_seconds_sum{endpoint="/v1/chat/completions",outcome="ok"}'
    assert metric_value(metrics, duration) >= 0.6


def test_server_errors_are_retried_elsewhere_and_open_the_circuit(pair: Callable) -> None:
    gateway, (a, b) = pair(balancing_policy="round_robin", circuit_breaker_failures=3)
    a.fail_status = 500
    for stream in (False, True, False, False, False, True):
        response = gateway.http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status_code == 200, response.text
        assert "[B]" in response.text
    # Round robin sends every other request to A first: 3 failures open its circuit, after
    # which A gets nothing although its heartbeat is fine.
    assert len(a.requests) == 3
    assert len(b.requests) == 6
    row = gateway.http.get("/backends").json()["backends"][0]
    assert row["circuit"] == "open" and row["is_healthy"] and row["num_failures"] == 3
    metrics = gateway.http.get("/metrics").text
    assert (
        metric_value(
            metrics, f'gateway_retries_total{{backend="{row["url"]}",reason="server_error"}}'
        )
        == 3
    )
    assert (
        metric_value(
            metrics,
            f'gateway_backend_circuit_open{{backend="{row["url"]}",kind="continuous_batching"}}',
        )
        == 1
    )


def test_overload_everywhere_returns_the_last_answer(pair: Callable) -> None:
    gateway, (a, b) = pair()
    a.fail_status = b.fail_status = 503
    response = gateway.http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503 and response.headers["retry-after"] == "7"
    assert len(a.requests) == 1 and len(b.requests) == 1  # each tried once, no loop
    # Overload is not a failure of the server: circuits stay closed.
    assert all(
        row["circuit"] == "closed" for row in gateway.http.get("/backends").json()["backends"]
    )
    # A 4xx is the request's fault: passed back at once, never retried.
    a.fail_status = b.fail_status = 404
    response = gateway.http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 404 and len(a.requests) + len(b.requests) == 3


def test_stream_fails_over_before_the_first_byte_but_not_after(pair: Callable) -> None:
    gateway, (a, b) = pair(balancing_policy="round_robin")
    a.break_stream_after = 0  # A's streams break before their first chunk
    response = gateway.http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200
    payloads = _sse_payloads(response.text)
    assert payloads[-1] == "[DONE]" and "[B]" in response.text and "[A]" not in response.text
    # Now A breaks after its first chunk: the caller already has bytes, so no retry; the
    # stream ends with an error event instead of hanging or switching servers mid-answer.
    a.break_stream_after = 1
    num_b = len(b.requests)
    response = gateway.http.post("/v1/chat/completions", json={**CHAT, "stream": True})  # to A
    payloads = _sse_payloads(response.text)
    assert payloads[0]["choices"][0]["delta"]["content"] == "[A]"
    assert payloads[-1]["error"]["code"] == 502 and "broke off" in payloads[-1]["error"]["message"]
    assert len(b.requests) == num_b
    # The openai SDK sees that as an error, not as a short answer.
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=5)
    b.fail_status = 503  # make sure the next stream lands on A
    with pytest.raises(openai.APIError, match="broke off"):
        for _ in client.chat.completions.create(**{**CHAT, "stream": True}):
            pass
    client.close()


def test_dead_server_costs_nothing_before_the_first_byte(pair: Callable) -> None:
    gateway, (a, b) = pair(balancing_policy="round_robin")
    a.answer_gate = threading.Event()  # A holds its answers
    results: list[httpx.Response] = []

    def call() -> None:
        url = f"{gateway.url}/v1/chat/completions"
        results.append(httpx.post(url, json=CHAT, timeout=20))

    thread = threading.Thread(target=call)
    thread.start()
    wait_until(lambda: len(a.requests), 5, until=lambda n: n == 1, message="the request to reach A")
    # A goes away with the request in flight (its connection is dropped). The caller has had
    # no byte yet, so the gateway retries on B and the caller never notices.
    a.server.stop()  # type: ignore[attr-defined]
    thread.join(20)
    assert results and results[0].status_code == 200, results and results[0].text
    assert "[B]" in results[0].text
    row = gateway.http.get("/backends").json()["backends"][0]
    assert row["num_in_flight"] == 0


def test_heartbeat_marks_down_after_two_failures_and_up_again(pair: Callable) -> None:
    interval = 0.3
    gateway, (a, b) = pair(heart_beat_interval_seconds=interval, num_failures_to_mark_down=2)
    rows = lambda: gateway.http.get("/backends").json()["backends"]  # noqa: E731
    assert all(row["is_healthy"] for row in rows())
    a.is_health_failing = True
    failed_at = time.monotonic()
    # Two failed heartbeats are needed; they come within two intervals (plus slack for a busy
    # machine: this bounds a hang, it is not a speed measurement).
    bound = 2 * interval + 2
    wait_until(lambda: rows()[0], bound, until=lambda r: not r["is_healthy"], message="A down")
    assert time.monotonic() - failed_at >= interval * 0.9  # one failure was not enough
    assert rows()[0]["num_consecutive_failures"] >= 2
    num_a = len(a.requests)
    for _ in range(4):
        assert gateway.http.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert len(a.requests) == num_a  # no traffic while down
    a.is_health_failing = False
    wait_until(lambda: rows()[0], bound, until=lambda r: r["is_healthy"], message="A up")
    for _ in range(4):
        assert gateway.http.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert len(a.requests) == num_a + 2  # back in rotation


def test_caller_api_keys(pair: Callable) -> None:
    gateway, _ = pair(api_keys=["caller-key-1", "caller-key-2"])
    http = gateway.http
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "caller-key-1"}):
        for method, path in (
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
            ("POST", "/generate"),
            ("GET", "/backends"),
            ("GET", "/openapi.json"),
            ("GET", "/docs"),
        ):
            response = http.request(method, path, json=CHAT, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["type"] == "authentication_error"
            assert response.headers["www-authenticate"] == "Bearer"
    ok = http.post(
        "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer caller-key-2"}
    )
    assert ok.status_code == 200
    assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    key = {"authorization": "Bearer caller-key-1"}
    schema = http.get("/openapi.json", headers=key)
    assert schema.status_code == 200
    # The request models are documented although the gateway forwards the caller's bytes.
    paths, components = schema.json()["paths"], schema.json()["components"]["schemas"]
    for path, model in (
        ("/generate", "GenerateRequest"),
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v2/models/{model}/generate_stream", "TritonGenerateRequest"),
    ):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert components[model]["type"] == "object"
    assert "messages" in components["ChatCompletionRequest"]["properties"]
    refs = re.findall(r"\"\$ref\": \"#/components/schemas/([^\"]+)\"", json.dumps(schema.json()))
    assert refs and all(name in components for name in refs)
    assert "swagger" in http.get("/docs", headers=key).text.lower()
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="caller-key-1", max_retries=0)
    assert client.chat.completions.create(**CHAT).choices[0].message.content.startswith("[")
    with pytest.raises(openai.AuthenticationError, match="API key is not valid"):
        client.with_options(api_key="wrong").chat.completions.create(**CHAT)
    client.close()


def test_route_header_is_validated(pair: Callable) -> None:
    gateway, _ = pair()
    response = gateway.http.post("/v1/chat/completions", json=CHAT, headers={"x-llm-route": "moon"})
    assert response.status_code == 400 and "X-LLM-Route" in response.json()["error"]["message"]
    # No jumper configured: an explicit upstream route has nowhere to go.
    response = gateway.http.post(
        "/v1/chat/completions", json=CHAT, headers={"x-llm-route": "openai"}
    )
    assert response.status_code == 503 and "OpenAI jumper" in response.json()["error"]["message"]


def test_config_reload_adds_and_removes_servers_without_dropping_requests(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from client_app import build_app

    settings = [FakeServerSettings(model_id="m", name=n, kind="continuous_batching") for n in "AB"]
    a, b = settings
    servers = [start_fake_server(s) for s in settings]
    config_path = tmp_path / "client_config.json"
    base = {"heart_beat_interval_seconds": 60, "config_watch_interval_seconds": 0.1}
    config_path.write_text(
        json.dumps({**base, "continuous_batching_server_urls": [servers[0].url]})
    )
    gateway = ServerThread(build_app(str(config_path))).start()
    try:
        # A request held on A while the config drops A and adds B.
        a.answer_gate = threading.Event()
        results: list[httpx.Response] = []
        url = f"{gateway.url}/v1/chat/completions"
        thread = threading.Thread(
            target=lambda: results.append(httpx.post(url, json=CHAT, timeout=20))
        )
        thread.start()
        wait_until(
            lambda: len(a.requests), 5, until=lambda n: n == 1, message="the request to reach A"
        )
        config_path.write_text(
            json.dumps({**base, "continuous_batching_server_urls": [servers[1].url]})
        )
        urls = lambda: [row["url"] for row in gateway.http.get("/backends").json()["backends"]]  # noqa: E731
        wait_until(urls, 5, until=lambda now: now == [servers[1].url], message="the reload")
        for _ in range(3):
            response = gateway.http.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 200 and "[B]" in response.text
        a.answer_gate.set()  # the held request finishes normally on the removed server
        thread.join(10)
        assert results[0].status_code == 200 and "[A]" in results[0].text
        # A broken file is ignored: the running config stays.
        config_path.write_text("{not json")
        wait_until(
            lambda: "config reload ignored" in caplog.text,
            5,
            message="the watcher to read the broken file and log that it ignores it",
        )
        assert urls() == [servers[1].url]
        assert gateway.http.post("/v1/chat/completions", json=CHAT).status_code == 200
    finally:
        stop_all(gateway, *servers)


def test_hung_server_requests_are_abandoned_and_retried_when_it_is_marked_down(
    pair: Callable,
) -> None:
    """A hung server accepts connections and never answers; the read timeout is long (60 s
    here), but once heartbeats mark it down its waiting requests go elsewhere."""
    interval = 0.2
    gateway, (a, b) = pair(
        balancing_policy="round_robin",
        heart_beat_interval_seconds=interval,
        request_timeout_seconds=60,
    )
    a.answer_gate = threading.Event()  # A never answers
    results: list[httpx.Response] = []

    def call() -> None:
        results.append(httpx.post(f"{gateway.url}/v1/chat/completions", json=CHAT, timeout=30))

    thread = threading.Thread(target=call)
    started = time.monotonic()
    thread.start()
    wait_until(lambda: len(a.requests), 5, until=lambda n: n == 1, message="the request to reach A")
    a.is_health_failing = True  # ... and its heartbeats fail
    thread.join(30)
    assert results and results[0].status_code == 200 and "[B]" in results[0].text
    assert time.monotonic() - started < 30  # far from the 60 s read timeout (bounds a hang)
    metrics = gateway.http.get("/metrics").text
    url_a = gateway.http.get("/backends").json()["backends"][0]["url"]
    sample = f'gateway_retries_total{{backend="{url_a}",reason="abandoned"}}'
    assert metric_value(metrics, sample) == 1
    attempts = f'gateway_requests_total{{backend="{url_a}",endpoint="{CHAT_PATH}",outcome='
    assert metric_value(metrics, attempts + '"abandoned"}') == 1
    assert metric_value(metrics, attempts + '"cancelled"}') == 0
    assert gateway.http.get("/backends").json()["backends"][0]["num_in_flight"] == 0
    a.answer_gate.set()


def test_sighup_reloads_the_config_of_a_standalone_gateway(tmp_path: Path) -> None:
    """``python client_app.py`` re-reads its config on SIGHUP (file watching off here)."""
    servers = [start_fake_server(FakeServerSettings(model_id=m, name=m)) for m in ("x", "y")]
    base = {"config_watch_interval_seconds": 0, "heart_beat_interval_seconds": 60}
    deployment = Deployment(tmp_path, num_servers=0)
    deployment.start_gateway({**base, "static_batching_server_urls": [servers[0].url]})
    process = deployment.processes["gateway"]

    def models() -> list[str]:
        try:
            answer = httpx.get(f"{deployment.gateway_url}/v1/models")
            return [card["id"] for card in answer.json()["data"]]
        except httpx.HTTPError:
            return []

    try:
        wait_until(models, 30, until=lambda now: now == ["x"], message="the gateway to start")
        deployment.write_config(
            "gateway", {**base, "static_batching_server_urls": [s.url for s in servers]}
        )
        # A negative check, so a pause rather than a wait: with watching off there is no event
        # to wait for, and a correct gateway passes however long the pause is.
        time.sleep(0.2)
        assert models() == ["x"]  # no watching: nothing changes by itself
        process.send_signal(signal.SIGHUP)
        wait_until(models, 10, until=lambda now: now == ["x", "y"], message="the reload")
        assert process.poll() is None  # reloaded, not restarted or stopped
    finally:
        deployment.stop(timeout=10)
        stop_all(*servers)


def test_a_silent_server_times_out_once_and_counts_as_a_failure(pair: Callable) -> None:
    gateway, (a,) = pair(num_servers=1, request_timeout_seconds=0.3)
    a.answer_gate = threading.Event()  # A never answers
    response = gateway.http.post(CHAT_PATH, json=CHAT)
    assert response.status_code == 504 and len(a.requests) == 1  # timeouts are not retried
    row = gateway.http.get("/backends").json()["backends"][0]
    assert row["num_in_flight"] == 0 and row["num_failures"] == 1
    metrics = gateway.http.get("/metrics").text
    attempts = f'gateway_requests_total{{backend="{row["url"]}",endpoint="{CHAT_PATH}",outcome='
    assert metric_value(metrics, attempts + '"timeout"}') == 1
    assert metric_value(metrics, attempts + '"cancelled"}') == 0
    a.answer_gate.set()
