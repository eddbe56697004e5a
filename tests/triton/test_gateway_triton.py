"""Triton interop on the gateway, over real HTTP.

1. Triton's generate API on the gateway (``/v2/models/{model}/generate[_stream]``), answered by
   our own servers: a client written for Triton + TensorRT-LLM works unchanged.
2. A real Triton server (PyTriton running transformers, as in seed 000) as a backend: native
   requests translated to Triton's generate API, heartbeats on Triton's ready endpoints, and
   failover between it and our servers.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import ServerThread, start_gateway, stop_all
from tests.support.default_model import DEMO_QUESTION as QUESTION
from tests.triton.triton_server import TritonServer


def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data:")]


# -- 1. Triton's API on the gateway, answered by our servers --------------------------------


def test_triton_generate_on_the_gateway(sb_gateway: ServerThread, chat_prompt: str) -> None:
    http = sb_gateway.http
    body = {"text_input": chat_prompt, "max_tokens": 16, "id": "req-7"}
    response = http.post("/v2/models/ensemble/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer == {
        "id": "req-7",
        "model_name": "ensemble",
        "model_version": "1",
        "text_output": answer["text_output"],
    }
    assert "Paris" in answer["text_output"]
    # generate_stream with "stream": true: text deltas that add up, no end marker.
    stream_body = {"text_input": chat_prompt, "max_tokens": 16, "stream": True}
    response = http.post("/v2/models/ensemble/generate_stream", json=stream_body, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _events(response)
    assert len(events) > 1 and "[DONE]" not in response.text
    assert all(set(event) == {"model_name", "model_version", "text_output"} for event in events)
    assert "".join(event["text_output"] for event in events) == answer["text_output"]
    # Without "stream": true, generate_stream sends the whole text as one event.
    response = http.post("/v2/models/ensemble/generate_stream", json={**body, "id": None})
    assert [event["text_output"] for event in _events(response)] == [answer["text_output"]]
    # The model may also be named by its gateway id.
    model = http.get("/v1/models").json()["data"][0]["id"]
    response = http.post(f"/v2/models/{model}/generate", json=body, timeout=60)
    assert response.json()["text_output"] == answer["text_output"]
    assert response.json()["model_name"] == model


def test_triton_api_errors_and_ready_endpoints(sb_gateway: ServerThread) -> None:
    http = sb_gateway.http
    for body, expected in [
        ({"text_input": "x", "max_tokens": 0}, "max_tokens"),
        ({"text_input": "x", "max_tokens": 4, "lora_task_id": 3}, "LoRA"),
        ({"text_input": "x", "max_tokens": 4, "presence_penalty": 2.5}, "presence_penalty"),
        ({"max_tokens": 4}, "text_input"),
    ]:
        response = http.post("/v2/models/ensemble/generate", json=body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert isinstance(error, str) and expected in error, (body, error)
    # TensorRT-LLM's additive penalties are served (as the native fields of those names).
    penalised = {"text_input": "1 1 1 1", "max_tokens": 4, "presence_penalty": 0.5}
    response = http.post("/v2/models/ensemble/generate", json=penalised, timeout=60)
    assert response.status_code == 200, response.text
    response = http.post("/v2/models/nope/generate", json={"text_input": "x", "max_tokens": 4})
    assert response.status_code == 404 and "nope" in response.json()["error"]
    assert http.get("/v2/health/live").status_code == 200
    assert http.get("/v2/health/ready").status_code == 200
    assert http.get("/v2/models/ensemble/ready").status_code == 200
    assert http.get("/v2/models/nope/ready").status_code == 400


def test_triton_api_overload_keeps_status_and_retry_after(tmp_path: Path) -> None:
    settings = FakeServerSettings(model_id="m", name="A", fail_status=503)
    server = start_fake_server(settings)
    gateway = start_gateway(tmp_path, [server.url])
    try:
        body = {"text_input": "x", "max_tokens": 4}
        response = gateway.http.post("/v2/models/m/generate", json=body)
        assert response.status_code == 503 and response.headers["retry-after"] == "7"
        assert response.json() == {"error": "failing (on purpose)"}
        # What the server received is a native request for the gateway's model.
        path, native = settings.requests[-1]
        assert path == "/generate" and native["model"] == "m" and native["prompt"] == "x"
        assert native["generation_config"]["max_new_tokens"] == 4
    finally:
        stop_all(gateway, server)


# -- 2. A real Triton server as a backend -----------------------------------------------------


def _triton_gateway(
    tmp_path: Path, triton: TritonServer, chat_template_from: Path | None = None, **config: object
) -> ServerThread:
    entry = {"url": triton.url, "models": {"smol": triton.model_name}, "default_max_tokens": 24}
    if chat_template_from is not None:
        entry["chat_template_from"] = str(chat_template_from)
    return start_gateway(tmp_path, triton_server_urls=[entry], **config)


@pytest.mark.slow
def test_native_requests_through_a_triton_backend(
    tmp_path: Path, triton: TritonServer, chat_prompt: str
) -> None:
    gateway = _triton_gateway(tmp_path, triton)
    http = gateway.http
    try:
        row = http.get("/backends").json()["backends"][0]
        assert row["kind"] == "triton" and row["is_healthy"] and row["model_ids"] == ["smol"]
        assert [card["id"] for card in http.get("/v1/models").json()["data"]] == ["smol"]
        body = {"model": "smol", "prompt": chat_prompt, "generation_config": {"max_new_tokens": 16}}
        response = http.post("/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        answer = response.json()
        text = answer["choices"][0]["text"]
        assert "Paris" in text and answer["model"] == "smol"
        assert answer["id"].startswith("triton-") and answer["choices"][0]["finish_reason"] is None
        # Streaming: native chunks, then the usage chunk and [DONE].
        response = http.post("/generate", json={**body, "stream": True}, timeout=60)
        lines = [line[6:] for line in response.text.splitlines() if line.startswith("data:")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
        assert "usage" in chunks[-1]
        assert len({chunk["id"] for chunk in chunks}) == 1  # one id for the whole stream
        # Beam search goes through too (Triton's beam_width).
        beams = {**body, "generation_config": {"max_new_tokens": 8, "num_beams": 2}}
        response = http.post("/generate", json=beams, timeout=60)
        assert response.status_code == 200, response.text
        # Triton's own API on the gateway, answered by the Triton backend: a round trip.
        triton_body = {"text_input": chat_prompt, "max_tokens": 16}
        response = http.post("/v2/models/smol/generate", json=triton_body, timeout=60)
        assert response.json()["text_output"] == text
        # Triton to Triton passes through untouched: the answer names the server's own model.
        assert response.json()["model_name"] == triton.model_name
        # What Triton cannot take is refused with the reason, not sent there.
        chat = {"model": "smol", "messages": [{"role": "user", "content": QUESTION}]}
        response = http.post("/generate", json=chat)
        assert response.status_code == 503 and "messages" in response.json()["error"]["message"]
        response = http.post("/v1/chat/completions", json=chat)
        assert response.status_code == 503
        typical = {**body, "generation_config": {"do_sample": True, "typical_p": 0.5}}
        response = http.post("/generate", json=typical)
        assert response.status_code == 503 and "typical_p" in response.text
    finally:
        gateway.stop()


@pytest.mark.slow
def test_openai_sdk_and_chats_through_a_triton_backend(
    tmp_path: Path, triton: TritonServer, default_model_path: Path, chat_prompt: str
) -> None:
    """With 'chat_template_from', the gateway renders chats for Triton: the OpenAI API and the
    native messages request work against a Triton-only deployment."""
    gateway = _triton_gateway(tmp_path, triton, chat_template_from=default_model_path)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=60)
    try:
        messages = [{"role": "user", "content": QUESTION}]
        chat = client.chat.completions.create(
            model="smol", messages=messages, max_tokens=16, temperature=0
        )
        text = chat.choices[0].message.content or ""
        assert "Paris" in text and chat.object == "chat.completion" and chat.model == "smol"
        stream = client.chat.completions.create(
            model="smol",
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage is not None and not chunks[-1].choices
        completion = client.completions.create(
            model="smol", prompt=chat_prompt, max_tokens=16, temperature=0
        )
        assert completion.choices[0].text == text
        native = {
            "model": "smol",
            "messages": messages,
            "generation_config": {"max_new_tokens": 16},
        }
        answer = gateway.http.post("/generate", json=native, timeout=60).json()
        assert answer["choices"][0]["text"] == text
        # Several prompts in one completion request have no native equivalent: refused.
        response = gateway.http.post(
            "/v1/completions", json={"model": "smol", "prompt": ["a", "b"], "max_tokens": 4}
        )
        assert response.status_code == 503 and "one text prompt" in response.text
    finally:
        client.close()
        gateway.stop()


@pytest.mark.slow
def test_failover_between_triton_and_our_server(
    tmp_path: Path, triton: TritonServer, chat_prompt: str
) -> None:
    """A Triton server and one of ours (a fake) both serve "smol": balanced as equals; when
    Triton answers errors, its requests go to ours and its circuit opens."""
    settings = FakeServerSettings(model_id="smol", name="ours", kind="continuous_batching")
    ours = start_fake_server(settings)
    gateway = _triton_gateway(
        tmp_path,
        triton,
        continuous_batching_server_urls=[ours.url],
        balancing_policy="round_robin",
        circuit_breaker_failures=1,
    )
    try:
        body = {"model": "smol", "prompt": chat_prompt, "generation_config": {"max_new_tokens": 8}}
        texts = [gateway.http.post("/generate", json=body, timeout=60).json() for _ in range(4)]
        from_ours = [t for t in texts if t["choices"][0]["text"].startswith("[ours]")]
        assert len(from_ours) == 2  # round robin over the CB server and the Triton server
        # Triton refuses the next request (unknown Triton model name): retried on ours.
        entry = {"url": triton.url, "models": {"smol": "missing-model"}}
        backend = gateway.app.state.gateway.registry.backends[1]
        backend.config = backend.config.model_copy(update=entry)
        for _ in range(3):
            response = gateway.http.post("/generate", json=body, timeout=60)
            assert response.status_code == 200 and "[ours]" in response.text
        row = gateway.http.get("/backends").json()["backends"][1]
        assert row["kind"] == "triton" and row["num_failures"] >= 1
    finally:
        stop_all(gateway, ours)
