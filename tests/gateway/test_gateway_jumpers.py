"""OpenAI jumpers over real HTTP: fallback when no local server can take a request, explicit
routes, model mapping, key rotation on 429, refused keys, and keys that never leak."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import ServerThread, start_gateway, stop_all
from harness.waiting import metric_value

KEYS = ["sk-jumper-one-0123456789abcdef", "sk-jumper-two-0123456789abcdef"]
NATIVE_CONFIG = {
    "max_new_tokens": 5,
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.9,
    "stop": ["\n\n"],
    "seed": 3,
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Setup:
    """A gateway over local fake server A (model "m") and two keys at fake upstream U."""

    def __init__(self, tmp_path: Path) -> None:
        self.local = FakeServerSettings(model_id="m", name="A", kind="continuous_batching")
        self.upstream = FakeServerSettings(model_id="gpt-up", name="U")
        self.local_server = start_fake_server(self.local)
        self.upstream_server = start_fake_server(self.upstream)
        jumpers = [
            {
                "api_key": key,
                "base_url": f"{self.upstream_server.url}/v1",
                "model_map": {"m": "gpt-up"},
            }
            for key in KEYS
        ]
        jumpers.append({"api_key": "YOUR_OPENAI_KEY", "base_url": f"{self.upstream_server.url}/v1"})
        self.gateway: ServerThread = start_gateway(
            tmp_path,
            continuous_batching_server_urls=[self.local_server.url],
            openai_jumper_configs=jumpers,
            retry_backoff_seconds=0.01,
        )

    def chat(self, **headers: str) -> tuple[int, str]:
        response = self.gateway.http.post("/v1/chat/completions", json=CHAT, headers=headers)
        return response.status_code, response.text

    def keys_used(self) -> list[str]:
        return [header.removeprefix("Bearer ") for header in self.upstream.authorizations]

    def stop(self) -> None:
        stop_all(self.gateway, self.local_server, self.upstream_server)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    setup = Setup(tmp_path)
    yield setup
    setup.stop()


def test_local_first_explicit_routes_and_model_map(setup: Setup) -> None:
    status, text = setup.chat()
    assert status == 200 and "[A]" in text
    assert setup.upstream.requests == []  # local servers first
    status, text = setup.chat(**{"x-llm-route": "openai"})
    assert status == 200 and "[U]" in text
    path, body = setup.upstream.requests[-1]
    assert path == "/v1/chat/completions" and body["model"] == "gpt-up"  # mapped
    assert setup.keys_used() == [KEYS[0]]
    # The placeholder entry is never used; the table lists only the two real keys.
    names = [row["name"] for row in setup.gateway.http.get("/backends").json()["backends"]]
    assert names[1:] == [f"openai[{i}]@{setup.upstream_server.url}/v1" for i in (0, 1)]


def test_fallback_when_no_local_server_can_take_the_request(setup: Setup) -> None:
    setup.local_server.stop()
    for stream in (False, True):
        response = setup.gateway.http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status_code == 200 and "[U]" in response.text
    # Least recently used key first: the two keys take turns.
    assert setup.keys_used() == [KEYS[0], KEYS[1]]
    models = setup.gateway.http.get("/v1/models").json()["data"]
    assert [(card["id"], card["owned_by"]) for card in models] == [("m", "openai-jumper")]
    metrics = setup.gateway.http.get("/metrics").text
    # The first request found A refusing connections (A was still thought healthy); the second
    # knew A was down.
    assert metric_value(metrics, 'gateway_fallbacks_total{reason="local_failed"}') == 1
    assert metric_value(metrics, 'gateway_fallbacks_total{reason="no_local_server"}') == 1
    # The native API is translated: messages -> chat completion, prompt -> completion.
    native = {"model": "m", "messages": CHAT["messages"], "generation_config": NATIVE_CONFIG}
    response = setup.gateway.http.post("/generate", json=native)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model"] == "m" and answer["usage"]["completion_tokens"] == 3
    assert answer["choices"] == [{"index": 0, "text": "[U] w1 w2", "finish_reason": "length"}]
    path, body = setup.upstream.requests[-1]
    assert path == "/v1/chat/completions"
    assert body == {
        "model": "gpt-up",
        "messages": CHAT["messages"],
        "max_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": ["\n\n"],
        "seed": 3,
    }
    stream = {"model": "m", "prompt": "hi", "stream": True}
    response = setup.gateway.http.post("/generate", json=stream)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "[U] w1 w2"
    assert chunks[-1]["usage"]["total_tokens"] == 5
    assert setup.upstream.requests[-1][0] == "/v1/completions"
    # What the OpenAI API cannot do is never sent there: a clear 503, not a different answer.
    beams = {"model": "m", "prompt": "hi", "generation_config": {"num_beams": 2}}
    response = setup.gateway.http.post("/generate", json=beams)
    assert response.status_code == 503
    assert "generation_config.num_beams" in response.json()["error"]["message"]
    # Routed "local" only: nothing local is up.
    assert setup.chat(**{"x-llm-route": "local"})[0] == 503


def test_overloaded_local_server_falls_back(setup: Setup) -> None:
    setup.local.fail_status = 503
    status, text = setup.chat()
    assert status == 200 and "[U]" in text
    metrics = setup.gateway.http.get("/metrics").text
    assert metric_value(metrics, 'gateway_fallbacks_total{reason="local_failed"}') == 1


def test_rate_limited_key_moves_traffic_to_the_next_key(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    setup.local_server.stop()
    setup.upstream.fail_status_by_key = {KEYS[0]: 429}
    texts = [setup.chat() for _ in range(3)]
    assert all(status == 200 and "[U]" in text for status, text in texts)
    # Key one answered 429 once, then rested (Retry-After 7 s): key two took everything.
    assert setup.keys_used() == [KEYS[0], KEYS[1], KEYS[1], KEYS[1]]
    rows = setup.gateway.http.get("/backends").json()["backends"]
    assert rows[1]["circuit"] == "open" and 5 < rows[1]["seconds_until_retry"] <= 7
    # Both keys refused (401): the caller gets a 502 about the gateway's credentials, and no key
    # appears anywhere: not in the answer, the table, the metrics or the log.
    setup.upstream.fail_status_by_key = {KEYS[0]: 401, KEYS[1]: 401}
    response = setup.gateway.http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 502 and "credentials" in response.json()["error"]["message"]
    # A 400 from upstream passes back, with the key scrubbed out of the upstream's message.
    setup.upstream.fail_status_by_key = {}
    setup.gateway.app.state.gateway.registry.backends[2].health.breaker.record_success()
    setup.upstream.fail_status_by_key = {KEYS[1]: 400}
    response = setup.gateway.http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 400 and "***" in response.text
    seen = [
        response.text,
        setup.gateway.http.get("/backends").text,
        setup.gateway.http.get("/metrics").text,
        setup.gateway.http.get("/health").text,
        caplog.text,
    ]
    for key in KEYS:
        assert not any(key in text or key[3:] in text for text in seen), key


def test_openai_sdk_through_a_jumper_to_a_real_server(
    tmp_path: Path, sb_server: ServerThread
) -> None:
    """The jumper's upstream is one of our own OpenAI-compatible servers with the real model."""
    model = sb_server.http.get("/v1/models").json()["data"][0]["id"]
    jumper = {"api_key": KEYS[0], "base_url": f"{sb_server.url}/v1", "model_map": {"smol": model}}
    gateway = start_gateway(tmp_path, openai_jumper_configs=[jumper])
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["smol"]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        completion = client.chat.completions.create(
            model="smol", messages=messages, max_tokens=12, temperature=0
        )
        assert "Paris" in (completion.choices[0].message.content or "")
        pieces = [
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model="smol", messages=messages, max_tokens=12, temperature=0, stream=True
            )
            if chunk.choices
        ]
        assert "".join(pieces) == completion.choices[0].message.content
        client.close()
    finally:
        gateway.stop()


def test_keys_are_scrubbed_from_streamed_upstream_errors(setup: Setup) -> None:
    setup.upstream.stream_error_message = "quota exceeded for key {key}; see your plan"
    route = {"x-llm-route": "openai"}
    http = setup.gateway.http
    answers = [
        http.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=route),
        http.post(
            "/generate",
            json={"model": "m", "prompt": "hi", "stream": True, "generation_config": NATIVE_CONFIG},
            headers=route,
        ),
        http.post(
            "/v2/models/m/generate_stream",
            json={"text_input": "hi", "max_tokens": 4, "stream": True},
            headers=route,
        ),
    ]
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert "quota exceeded for key ***" in answer.text, answer.text
        assert not any(key in answer.text or key[3:] in answer.text for key in KEYS)
