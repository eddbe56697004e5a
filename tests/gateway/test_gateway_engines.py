"""OpenAI-compatible engines as first-tier servers, over real sockets: our SB server behind an
OpenAI-API-only facade (no native routes, no /health) stands in for ``vllm serve``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from client.backends.prometheus_load import load_from_metrics
from harness.servers import ServerThread, start_gateway, stop_all
from tests.support.openai_facade import FacadeSettings, start_facade

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
KEY = "engine-key-123"
#: The gateway, the facade's settings (what it saw) and the model id.
Engine = tuple[ServerThread, FacadeSettings, str]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, sb_server: ServerThread) -> Iterator[Engine]:
    """A gateway whose only server is the facade over the SB server (key from the env)."""
    settings = FacadeSettings(backend_url=sb_server.url, required_key=KEY)
    facade = start_facade(settings)
    model = sb_server.http.get("/v1/models").json()["data"][0]["id"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ENGINE_KEY", KEY)
        gateway = start_gateway(
            tmp_path_factory.mktemp("engine"),
            openai_compatible_server_urls=[
                {"url": f"{facade.url}/v1", "api_key": {"env": "ENGINE_KEY"}}
            ],
        )
    yield gateway, settings, model
    stop_all(gateway, facade)


def test_engine_is_heartbeaten_through_v1_models_and_its_models_learnt(engine: Engine) -> None:
    gateway, settings, model = engine
    row = gateway.http.get("/backends").json()["backends"][0]
    assert row["kind"] == "openai_compatible" and row["is_healthy"], row
    assert row["model_ids"] == [model]
    assert row["max_model_len"] is not None  # read from the engine's /v1/models card
    assert "/v1/models" in settings.paths and "/health" not in settings.paths
    assert gateway.http.get("/v1/models").json()["data"][0]["id"] == model


def test_openai_sdk_chat_through_the_engine(engine: Engine) -> None:
    gateway, settings, model = engine
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=16
    )
    print("SDK chat through a foreign engine:", chat.choices[0].message.content)
    assert "Paris" in (chat.choices[0].message.content or "")
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=16, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content
    client.close()
    assert settings.paths.count("/v1/chat/completions") == 2


def test_native_and_triton_requests_are_translated(engine: Engine) -> None:
    gateway, settings, model = engine
    native = {"model": model, "messages": QUESTION, "generation_config": {"max_new_tokens": 16}}
    answer = gateway.http.post("/generate", json=native, timeout=120)
    assert answer.status_code == 200, answer.text
    assert "Paris" in answer.json()["choices"][0]["text"]
    text_input = "The capital of France is"
    triton = gateway.http.post(
        "/v2/models/ensemble/generate",
        json={"text_input": text_input, "max_tokens": 4},
        timeout=120,
    )
    assert triton.status_code == 200, triton.text
    assert triton.json()["text_output"]
    assert "/generate" not in settings.paths and "/v1/completions" in settings.paths


def test_what_the_openai_api_cannot_say_gets_503_naming_the_fields(engine: Engine) -> None:
    gateway, _, model = engine
    native = {"model": model, "prompt": "Hi", "generation_config": {"num_beams": 2, "top_k": 5}}
    answer = gateway.http.post("/generate", json=native)
    assert answer.status_code == 503, answer.text
    message = answer.json()["error"]["message"]
    assert "generation_config.num_beams" in message and "generation_config.top_k" in message


def test_load_is_read_from_vllm_gauges(tmp_path: Path, sb_server: ServerThread) -> None:
    """A facade whose /metrics reports a queue gets less traffic than one that reports none;
    the SB server's own vLLM series (proxied) parse as a load too."""
    real_metrics = sb_server.http.get("/metrics").text
    assert load_from_metrics(real_metrics) is not None
    model = sb_server.http.get("/v1/models").json()["data"][0]["id"]
    gauges = (
        f'vllm:num_requests_running{{model_name="{model}"}} 3.0\n'
        f'vllm:num_requests_waiting{{model_name="{model}"}} 7.0\n'
    )
    busy = FacadeSettings(sb_server.url, is_serving_metrics=True, metrics_text=gauges)
    idle = FacadeSettings(sb_server.url, is_serving_metrics=True)
    plain = FacadeSettings(sb_server.url)
    facades = [start_facade(s) for s in (busy, idle, plain)]
    gateway = start_gateway(
        tmp_path, openai_compatible_server_urls=[{"url": f.url} for f in facades]
    )
    try:
        rows = gateway.http.get("/backends").json()["backends"]
        assert rows[0]["load"]["num_running"] == 3 and rows[0]["load"]["num_waiting"] == 7
        assert [r["is_healthy"] for r in rows] == [True, True, True]
        body = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        for _ in range(4):
            assert gateway.http.post("/v1/completions", json=body, timeout=60).status_code == 200
        assert busy.paths.count("/v1/completions") == 0
        assert idle.paths.count("/v1/completions") + plain.paths.count("/v1/completions") == 4
    finally:
        stop_all(gateway, *facades)
