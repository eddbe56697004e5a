"""OpenAI-compatible engines under failure, with fake engines: a kill under load, the engine's
key, and the pieces (metrics parsing, config entries) on their own."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from client.backends.prometheus_load import load_from_metrics
from client.config.schema import ClientConfig
from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import start_gateway, stop_all
from harness.waiting import wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_killed_engine_under_load_costs_no_request(tmp_path: Path) -> None:
    """Engine A dies with requests waiting on it: they are retried on B before any byte reached
    their callers, the key went with every request, and A is marked down."""
    a = FakeServerSettings(model_id="m", name="A", answer_gate=threading.Event())
    b = FakeServerSettings(model_id="m", name="B")
    server_a, server_b = start_fake_server(a), start_fake_server(b)
    entries = [{"url": s.url, "api_key": "k-engine"} for s in (server_a, server_b)]
    gateway = start_gateway(
        tmp_path,
        openai_compatible_server_urls=entries,
        balancing_policy="round_robin",
        retry_backoff_seconds=0.01,
    )
    url = f"{gateway.url}/v1/chat/completions"
    try:
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(httpx.post, url, json=CHAT, timeout=30) for _ in range(32)]
            wait_until(lambda: len(a.requests), 10, until=lambda n: n >= 4, message="load on A")
            server_a.stop()  # connections to A drop with requests in flight
            answers = [future.result() for future in futures]
        assert [r.status_code for r in answers] == [200] * 32, [r.text for r in answers]
        assert sum("[B]" in r.text for r in answers) >= 4
        assert set(a.authorizations + b.authorizations) == {"Bearer k-engine"}
        # A is out of rotation: marked down (a refused connection) or its circuit open (the
        # connections it broke), whichever came first; nothing is left in flight.
        for _ in range(4):
            assert "[B]" in httpx.post(url, json=CHAT, timeout=30).text
        rows = gateway.http.get("/backends").json()["backends"]
        assert rows[0]["kind"] == "openai_compatible", rows[0]
        assert not rows[0]["is_healthy"] or rows[0]["circuit"] != "closed", rows[0]
        assert all(row["num_in_flight"] == 0 for row in rows)
    finally:
        stop_all(gateway, server_b)


def test_engine_key_is_scrubbed_from_errors(tmp_path: Path) -> None:
    settings = FakeServerSettings(model_id="m", fail_status_by_key={"k-secret": 400})
    server = start_fake_server(settings)
    entry = {"url": server.url, "models": ["m"], "api_key": "k-secret", "health_path": "/health"}
    gateway = start_gateway(tmp_path, openai_compatible_server_urls=[entry])
    try:
        answer = gateway.http.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 400 and "k-secret" not in answer.text, answer.text
    finally:
        stop_all(gateway, server)


def test_vllm_gauges_are_summed_over_models() -> None:
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="a b"} 2.0\n'
        'vllm:num_requests_running{engine="0",model_name="c"} 1.0\n'
        'vllm:num_requests_waiting{model_name="a b"} 5.0\n'
        "vllm:num_requests_swapped 1\n"
        "vllm:num_requests_running_total 99\n"
    )
    load = load_from_metrics(text)
    assert load is not None
    assert (load.num_running, load.num_waiting, load.num_swapped) == (3, 5, 1)
    assert load_from_metrics("llm_requests_total 3\n") is None


def test_engine_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KEY", "s3cret")
    config = ClientConfig.model_validate(
        {
            "openai_compatible_server_urls": [
                {"url": "http://10.0.0.5:8000/v1/", "api_key": {"env": "VLLM_KEY"}}
            ]
        }
    )
    entry = config.openai_compatible_server_urls[0]
    assert entry.url == "http://10.0.0.5:8000" and entry.api_key is not None
    assert entry.api_key.get_secret_value() == "s3cret" and "s3cret" not in repr(config)
    with pytest.raises(ValidationError, match="listed"):
        ClientConfig.model_validate(
            {
                "continuous_batching_server_urls": ["http://a:1"],
                "openai_compatible_server_urls": [{"url": "http://a:1"}],
            }
        )
    with pytest.raises(ValidationError, match="must start with '/'"):
        ClientConfig.model_validate(
            {"openai_compatible_server_urls": [{"url": "http://a:1", "health_path": "health"}]}
        )
