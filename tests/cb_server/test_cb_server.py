"""The continuous-batching server over HTTP, alone and behind the gateway (real default model)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from harness.servers import ServerThread, start_gateway
from harness.waiting import wait_until
from protocol.generation import GenerationConfig
from protocol.openai_api import ChatCompletionChunk
from server.common.app import create_server_app
from server.common.service import ServingSettings
from server.continuous_batching.async_engine import AsyncEngine
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import (
    MODEL_ID,
    assert_still_serves,
    chat_body,
    engine_config,
)

NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def cb_engine(default_model_path: Path, cb_runner: ModelRunner) -> LLMEngine:
    return LLMEngine(engine_config(default_model_path, num_blocks=NUM_BLOCKS), runner=cb_runner)


@pytest.fixture(scope="module")
def cb_server(cb_engine: LLMEngine) -> Iterator[ServerThread]:
    backend = AsyncEngine(cb_engine, MODEL_ID)
    settings = ServingSettings(served_model_names=[MODEL_ID], default_max_new_tokens=32)
    server = ServerThread(create_server_app(backend, settings)).start(timeout_seconds=60)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, cb_server: ServerThread, sb_server: ServerThread
) -> Iterator[ServerThread]:
    """A gateway with both kinds of server for the same model: CB must be preferred."""
    gw = start_gateway(
        tmp_path_factory.mktemp("cb-gateway"),
        continuous_batching_server_urls=[cb_server.url],
        static_batching_server_urls=[sb_server.url],
    )
    yield gw
    gw.stop()


def _health(server: ServerThread) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def test_health_reports_the_kv_cache(cb_server: ServerThread) -> None:
    health = _health(cb_server)
    assert health["kind"] == "continuous_batching" and health["model"] == MODEL_ID
    assert health["load"]["num_kv_blocks_total"] == NUM_BLOCKS
    assert health["load"]["num_kv_blocks_free"] == NUM_BLOCKS


def test_gateway_prefers_cb_and_http_equals_offline(
    gateway: ServerThread, cb_server: ServerThread, cb_engine: LLMEngine
) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    before = httpx.get(f"{cb_server.url}/metrics", timeout=10).text.count('outcome="200"')
    chat = client.chat.completions.create(
        model=MODEL_ID, messages=question, temperature=0, max_tokens=16
    )
    assert "Paris" in chat.choices[0].message.content
    metrics = httpx.get(f"{cb_server.url}/metrics", timeout=10).text
    assert 'llm_requests_total{endpoint="/v1/chat/completions",outcome="200"}' in metrics
    for name in ("llm_preemptions_swap_total", "llm_num_kv_blocks_free", "llm_engine_steps_total"):
        assert name in metrics
    assert metrics.count('outcome="200"') >= before
    # The same greedy request offline through the engine gives the same text.
    tokenizer = cb_engine.tokenizer
    prompt = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    (deltas,) = cb_engine.generate([ids], [GenerationConfig(max_new_tokens=16)])
    assert "".join(d.text for d in deltas) == chat.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=question, temperature=0, max_tokens=16, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content


def test_disconnect_mid_stream_frees_blocks(gateway: ServerThread, cb_server: ServerThread) -> None:
    body = {
        "prompt": "Tell me a very long story.",
        "generation_config": {"max_new_tokens": 1000, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", f"{gateway.url}/generate", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                assert _health(cb_server)["load"]["num_running"] == 1
                break
    wait_until(
        lambda: _health(cb_server)["load"],
        20,
        interval=0.05,
        until=lambda load: load["num_running"] == 0 and load["num_kv_blocks_free"] == NUM_BLOCKS,
        message="the aborted request to leave and free its blocks",
    )


async def test_fifty_concurrent_mixed_requests(cb_server: ServerThread) -> None:
    configs = [
        {"max_new_tokens": 6},
        {"max_new_tokens": 8, "do_sample": True, "temperature": 0.8, "top_p": 0.9, "seed": 5},
        {"max_new_tokens": 5, "num_beams": 2, "num_return_sequences": 2},
        {"max_new_tokens": 4, "do_sample": True, "top_k": 10, "num_return_sequences": 3},
        {"max_new_tokens": 7, "repetition_penalty": 1.2, "stop": ["\n"]},
    ] * 10
    async with httpx.AsyncClient(base_url=cb_server.url, timeout=300) as client:
        responses = await asyncio.gather(
            *[
                client.post("/generate", json={"prompt": f"Item {i}:", "generation_config": c})
                for i, c in enumerate(configs)
            ]
        )
    for config, response in zip(configs, responses, strict=True):
        assert response.status_code == 200, response.text
        body = response.json()
        assert len(body["choices"]) == config.get("num_return_sequences", 1)
        assert all(c["finish_reason"] in ("stop", "length") for c in body["choices"])
        assert 0 < body["usage"]["completion_tokens"]
    assert _health(cb_server)["load"]["num_kv_blocks_free"] == NUM_BLOCKS


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "generation_config": {"temperature": -1}},
        {"prompt": "x", "generation_config": {"num_beams": 100}},
        {"prompt": "hi " * 9000, "generation_config": {"max_new_tokens": 2}},
        {"prompt": "x", "generation_config": {"max_new_tokens": 2}, "extra": 1},
    ],
)
def test_bad_bodies_get_4xx_and_server_keeps_serving(cb_server: ServerThread, body: dict) -> None:
    response = httpx.post(f"{cb_server.url}/generate", content=json.dumps(body), timeout=60)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["message"] and error["code"] == response.status_code
    assert_still_serves(cb_server.url)


def test_a_stream_sends_one_event_per_step(cb_server: ServerThread) -> None:
    """Both choices of a step travel in one chat chunk; each opens with the assistant role."""
    max_tokens = 6
    body = chat_body("Name a colour.", n=2, temperature=0.8, seed=3, max_tokens=max_tokens)
    body.update(ignore_eos=True, stream=True, stream_options={"include_usage": True})
    url = f"{cb_server.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    *events, usage = chunks
    assert usage["usage"]["completion_tokens"] == 2 * max_tokens
    assert 0 < len(events) <= max_tokens  # at most one event per engine step
    seen: dict[int, list[dict]] = {0: [], 1: []}
    for event in events:
        assert ChatCompletionChunk.model_validate(event).model_dump(mode="json") == event
        indices = [c["index"] for c in event["choices"]]
        assert len(indices) == len(set(indices))
        for choice in event["choices"]:
            seen[choice["index"]].append(choice)
    for choices in seen.values():
        assert [c["delta"].get("role") for c in choices][:1] == ["assistant"]
        assert all(c["delta"].get("role") is None for c in choices[1:])
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
