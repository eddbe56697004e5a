"""End to end: caller -> gateway -> static-batching server -> transformers, over real sockets."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from harness.servers import ServerThread
from harness.waiting import wait_until
from tests.support.default_model import MODEL_ID, assert_still_serves

QUESTION = "What is the capital of France?"


def _sse_payloads(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_chat_through_gateway_answers_paris(sb_gateway: ServerThread) -> None:
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": QUESTION}],
        "generation_config": {"max_new_tokens": 24},
    }
    response = httpx.post(f"{sb_gateway.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert "Paris" in answer["choices"][0]["text"]
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["completion_tokens"] <= 24


def test_native_stream_through_gateway(sb_gateway: ServerThread) -> None:
    config = {"max_new_tokens": 8, "ignore_eos": True}
    body = {"prompt": "The capital of France is", "generation_config": config, "stream": True}
    with httpx.stream("POST", f"{sb_gateway.url}/generate", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = _sse_payloads(list(response.iter_lines()))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    text_chunks = [c for c in chunks if c["choices"]]
    assert len(text_chunks) >= 2, "tokens should arrive as several events"
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    streamed = "".join(c["choices"][0]["text"] for c in text_chunks)
    # The same request without streaming gives the same greedy text.
    plain = httpx.post(
        f"{sb_gateway.url}/generate", json={**body, "stream": False}, timeout=60
    ).json()
    assert plain["choices"][0]["text"] == streamed


def test_openai_sdk_against_gateway(sb_gateway: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{sb_gateway.url}/v1", api_key="unused", max_retries=0)
    assert MODEL_ID in [m.id for m in client.models.list().data]

    messages = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(
        model=MODEL_ID, messages=messages, temperature=0, max_tokens=24
    )
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.completion_tokens > 0

    streaming = {"stream": True, "stream_options": {"include_usage": True}}
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=messages, temperature=0, max_tokens=24, **streaming
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    completion = client.completions.create(
        model=MODEL_ID, prompt="Once upon a time", max_tokens=6, n=2, seed=7, temperature=0.8
    )
    again = client.completions.create(
        model=MODEL_ID, prompt="Once upon a time", max_tokens=6, n=2, seed=7, temperature=0.8
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert [c.text for c in completion.choices] == [c.text for c in again.choices]


def test_too_long_prompt_refused_with_numbers(sb_gateway: ServerThread) -> None:
    body = {"model": MODEL_ID, "prompt": "hello " * 9000, "max_tokens": 4}
    response = httpx.post(f"{sb_gateway.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "8192" in error["message"] and "tokens" in error["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x", "generation_config": {"top_p": 0}}, "generation_config.top_p"),
        ({"generation_config": {"max_new_tokens": 2}}, None),
        ({"prompt": "x", "generation_config": {"num_beams": 2, "num_return_sequences": 3}}, None),
    ],
)
def test_bad_bodies_get_400_and_server_keeps_serving(
    sb_gateway: ServerThread, sb_server: ServerThread, body: dict, field: str | None
) -> None:
    for url in (sb_gateway.url, sb_server.url):
        response = httpx.post(f"{url}/generate", json=body, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == 400 and error["message"]
        if field:
            assert error["param"] == field
    assert_still_serves(sb_gateway.url)


def test_unknown_model_is_404_listing_served_models(sb_gateway: ServerThread) -> None:
    body = {"model": "no-such-model", "prompt": "x", "max_tokens": 2}
    response = httpx.post(f"{sb_gateway.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 404
    assert MODEL_ID in response.json()["error"]["message"]


async def test_concurrent_mixed_requests_each_get_their_answer(sb_gateway: ServerThread) -> None:
    configs = [
        {"max_new_tokens": 4},
        {"max_new_tokens": 5, "do_sample": True, "temperature": 0.7, "seed": 3},
        {"max_new_tokens": 4, "num_beams": 2, "num_return_sequences": 2},
        {"max_new_tokens": 3, "do_sample": True, "num_return_sequences": 3},
    ] * 3
    prompts = [f"Count to {i}:" for i in range(len(configs))]
    async with httpx.AsyncClient(base_url=sb_gateway.url, timeout=120) as client:
        responses = await asyncio.gather(
            *[
                client.post("/generate", json={"prompt": p, "generation_config": c})
                for p, c in zip(prompts, configs, strict=True)
            ]
        )
    for config, response in zip(configs, responses, strict=True):
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert len(choices) == config.get("num_return_sequences", 1)
        assert all(c["finish_reason"] in ("stop", "length") for c in choices)


def test_disconnect_mid_stream_frees_the_server(
    sb_gateway: ServerThread, sb_server: ServerThread
) -> None:
    body = {
        "prompt": "Write a long story about a dragon.",
        "generation_config": {"max_new_tokens": 2000, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", f"{sb_gateway.url}/generate", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # got the first token; hang up
    wait_until(
        lambda: httpx.get(f"{sb_server.url}/health", timeout=10).json()["load"],
        30,
        interval=0.1,
        until=lambda load: load["num_running"] == 0 and load["num_waiting"] == 0,
        message="the server to drop the request whose caller hung up",
    )
