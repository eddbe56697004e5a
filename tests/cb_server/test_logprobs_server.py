"""Logprobs through the gateway with the ``openai`` SDK on the CB server: chat ``logprobs`` with
``top_logprobs`` (whole and streamed: a greedy stream's entries are the whole answer's),
completions ``logprobs``, ``echo`` with the prompt's logprobs (as lm-evaluation-harness asks),
the native ``generation_config.logprobs`` and ``prompt_logprobs``; the 400s naming the field
(bounds, ``top_logprobs`` without ``logprobs``, beam search, the SB server)."""

from __future__ import annotations

import json
import math
from typing import Any

import openai
import pytest

from harness.servers import ServerThread
from tests.support.default_model import DEMO_QUESTION, MODEL_ID

ASK = [{"role": "user", "content": DEMO_QUESTION}]


def _entries(content: list[Any]) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]


def test_chat_logprobs_whole_and_streamed(client: Any) -> None:
    options = {"model": MODEL_ID, "messages": ASK, "max_tokens": 8, "temperature": 0}
    answer = client.chat.completions.create(**options, logprobs=True, top_logprobs=3)
    choice = answer.choices[0]
    content = choice.logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 3
        assert bytes(entry.bytes).decode("utf-8") == entry.token
        # Greedy: the chosen token is the likeliest.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    # One entry per generated token, the stop id (no text in the answer) included.
    assert "".join(e.token for e in content) == choice.message.content + "<|im_end|>"
    streamed = []
    for chunk in client.chat.completions.create(
        **options, logprobs=True, top_logprobs=3, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert _entries(streamed) == _entries(content)
    plain = client.chat.completions.create(**options)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content


def test_completions_logprobs(client: Any) -> None:
    answer = client.completions.create(
        model=MODEL_ID, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    choice = answer.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert all(math.isfinite(v) and v <= 0 for v in logprobs.token_logprobs)
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[-1] == len(choice.text) - len(logprobs.tokens[-1])


def test_completions_echo_with_prompt_logprobs(client: Any) -> None:
    """lm-evaluation-harness's loglikelihood request: ``echo``, ``logprobs`` 1, one token. The
    answer opens with the prompt and its tokens' logprobs (the first one null), a prompt's
    scores do not depend on what follows it, and streamed equals whole."""
    prompt = "The capital of France is"
    options = {"model": MODEL_ID, "temperature": 0, "echo": True, "logprobs": 1}
    answer = client.completions.create(**options, prompt=prompt, max_tokens=1)
    choice = answer.choices[0]
    logprobs = choice.logprobs
    num_prompt = answer.usage.prompt_tokens
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    assert len(logprobs.tokens) == num_prompt + 1 == len(logprobs.token_logprobs)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens[:num_prompt]) == prompt
    assert "".join(logprobs.tokens) == choice.text
    assert all(v <= 0 for v in logprobs.token_logprobs[1:])
    assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])
    # Greedy: the generated token is the likeliest; a prompt token may not be.
    assert logprobs.token_logprobs[-1] == pytest.approx(max(logprobs.top_logprobs[-1].values()))
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    longer = client.completions.create(**options, prompt=prompt + " Paris", max_tokens=0)
    assert longer.choices[0].text == prompt + " Paris"
    assert longer.choices[0].finish_reason == "length"
    assert longer.usage.completion_tokens == 0
    prefix_scores = longer.choices[0].logprobs.token_logprobs[1:num_prompt]
    assert prefix_scores == pytest.approx(logprobs.token_logprobs[1:num_prompt], abs=1e-4)
    assert len(longer.choices[0].logprobs.tokens) == longer.usage.prompt_tokens
    text, tokens, scores = "", [], []
    for chunk in client.completions.create(**options, prompt=prompt, max_tokens=3, stream=True):
        for streamed in chunk.choices:
            text += streamed.text
            if streamed.logprobs is not None:
                tokens += streamed.logprobs.tokens
                scores += streamed.logprobs.token_logprobs
    whole = client.completions.create(**options, prompt=prompt, max_tokens=3).choices[0]
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert scores == whole.logprobs.token_logprobs
    plain = client.completions.create(
        model=MODEL_ID, prompt=[prompt, "Hello"], max_tokens=2, temperature=0, echo=True
    )
    assert [c.text[: len(p)] for c, p in zip(plain.choices, [prompt, "Hello"], strict=True)] == [
        prompt,
        "Hello",
    ]
    assert all(c.logprobs is None for c in plain.choices)


def test_native_generate_logprobs(gateway: Any) -> None:
    body = {
        "model": MODEL_ID,
        "prompt": "The capital of France is",
        "generation_config": {"max_new_tokens": 5, "logprobs": 2},
    }
    answer = gateway.http.post("/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    assert len(choice["logprobs"]) == 5
    for entry in choice["logprobs"]:
        assert set(entry) == {"token_id", "token", "logprob", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]
    streamed = []
    with gateway.http.stream(
        "POST", "/generate", json={**body, "stream": True}, timeout=60
    ) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                for streamed_choice in json.loads(line[6:])["choices"]:
                    streamed += streamed_choice.get("logprobs") or []
    assert streamed == choice["logprobs"]
    scored = gateway.http.post(
        "/generate",
        json={**body, "generation_config": {"max_new_tokens": 1, "prompt_logprobs": 0}},
        timeout=60,
    )
    assert scored.status_code == 200, scored.text
    (choice,) = scored.json()["choices"]
    num_prompt = scored.json()["usage"]["prompt_tokens"]
    assert [len(e["top_logprobs"]) for e in choice["prompt_logprobs"]] == [0] * (num_prompt - 1)


def test_bad_logprobs_requests_are_400s(client: Any) -> None:
    chat = {"model": MODEL_ID, "messages": ASK, "max_tokens": 4}
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(**chat, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(**chat, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=4, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="beam search"):
        client.chat.completions.create(
            **chat, n=2, logprobs=True, extra_body={"use_beam_search": True}
        )


def test_completions_give_up_to_20_alternatives_as_vllm_does(client: Any) -> None:
    answer = client.completions.create(
        model=MODEL_ID, prompt="The capital of France is", max_tokens=2, logprobs=20, temperature=0
    )
    top = answer.choices[0].logprobs.top_logprobs
    assert [len(alternatives) for alternatives in top] == [20, 20]


def test_the_static_batching_server_says_it_cannot(sb_server: ServerThread) -> None:
    body = {"messages": ASK, "max_tokens": 4, "logprobs": True}
    answer = sb_server.http.post("/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "logprobs" and "continuous-batching" in error["message"]
    echo = {"prompt": "Hi", "max_tokens": 1, "echo": True, "logprobs": 1}
    answer = sb_server.http.post("/v1/completions", json=echo, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "logprobs"
    answer = sb_server.http.post("/v1/completions", json={**echo, "logprobs": None}, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"].startswith("Hi")


def test_gateway_translations_decline_native_logprobs() -> None:
    """A Triton server has no logprobs output and an OpenAI upstream answers them in another
    shape: a native request asking for them goes to neither (rather than losing them)."""
    from client.backends.native_to_openai import upstream_unsupported_fields
    from client.triton.protocol import TritonGenerateRequest
    from protocol.generation import GenerateRequest

    request = GenerateRequest(prompt="Hi", generation_config={"logprobs": 2})
    assert "generation_config.logprobs" in upstream_unsupported_fields(request)
    with pytest.raises(ValueError, match="logprobs"):
        TritonGenerateRequest.from_generate_request(request, "Hi", default_max_tokens=4)


def test_vllm_prompt_logprobs_on_the_openai_routes(gateway: Any, sb_server: ServerThread) -> None:
    """vLLM's ``prompt_logprobs``: per prompt token (None first) ``{id: {logprob, rank,
    decoded_token}}``, the same figures as the native ``prompt_logprobs``."""
    prompt = "The capital of France is"
    native = gateway.http.post(
        "/generate",
        json={"prompt": prompt, "generation_config": {"max_new_tokens": 1, "prompt_logprobs": 2}},
        timeout=60,
    ).json()["choices"][0]["prompt_logprobs"]
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    answer = gateway.http.post("/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    scored = answer.json()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(native) + 1
    for position, entry in zip(scored[1:], native, strict=True):
        own = position[str(entry["token_id"])]
        assert own["logprob"] == entry["logprob"] and own["decoded_token"] == entry["token"]
        tops = entry["top_logprobs"]
        assert [position[str(t["token_id"])]["rank"] for t in tops] == [1, 2]
        assert len(position) == len({entry["token_id"], *(t["token_id"] for t in tops)})
    plain = gateway.http.post("/v1/completions", json={**body, "prompt_logprobs": None})
    assert "prompt_logprobs" not in plain.json()["choices"][0]
    chat = {"model": MODEL_ID, "messages": ASK, "max_tokens": 1, "prompt_logprobs": 0}
    whole = gateway.http.post("/v1/chat/completions", json=chat, timeout=60).json()
    assert whole["prompt_logprobs"][0] is None
    assert len(whole["prompt_logprobs"]) == whole["usage"]["prompt_tokens"]
    refused = [
        (gateway, {**body, "stream": True}, "stream"),
        (gateway, {**body, "echo": True, "logprobs": 1}, "must equal"),
        (gateway, {**body, "prompt_logprobs": 21}, "prompt_logprobs"),
        (sb_server, body, "'prompt_logprobs' is not supported"),
    ]
    for server, sent, reason in refused:
        answer = server.http.post("/v1/completions", json=sent, timeout=60)
        assert answer.status_code == 400 and reason in answer.text, answer.text
