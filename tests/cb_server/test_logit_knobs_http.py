"""OpenAI's sampling knobs over HTTP on a CB server (and through a gateway in front of it):
``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and ``min_p`` are accepted on
``/v1/chat/completions``, ``/v1/completions`` and native ``/generate``, and bad values get a
400 naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from harness.servers import ServerThread
from tests.support.default_model import DEMO_QUESTION, MODEL_ID

PARIS = 7042  # " Paris": greedy's answer to the demo question


def _chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": DEMO_QUESTION}],
        "max_tokens": 8,
        "temperature": 0,
        **fields,
    }


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "prompt": "1 1 1 1 1 1", "max_tokens": 8, "temperature": 0, **fields}


def _ok(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(url + path, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_chat_and_completions_accept_the_knobs(
    cb_server: ServerThread, gateway: ServerThread
) -> None:
    for url in (cb_server.url, gateway.url):
        plain = _ok(url, "/v1/chat/completions", _chat())["choices"][0]["message"]["content"]
        assert "Paris" in plain
        banned = _ok(url, "/v1/chat/completions", _chat(logit_bias={str(PARIS): -100}, min_p=0.05))
        assert "Paris" not in banned["choices"][0]["message"]["content"]
        repeated = _ok(url, "/v1/completions", _completion())["choices"][0]["text"]
        penalised = _ok(
            url, "/v1/completions", _completion(frequency_penalty=2.0, presence_penalty=0.5)
        )["choices"][0]["text"]
        assert repeated.count("1") == 4 and penalised.count("1") <= 1
        sampled = _ok(
            url,
            "/v1/completions",
            _completion(temperature=1.0, min_p=0.2, seed=3, logit_bias={"42": 1.5}),
        )
        assert sampled["usage"]["completion_tokens"] > 0


def test_native_generate_takes_the_same_names(cb_server: ServerThread) -> None:
    config = {"max_new_tokens": 5, "ignore_eos": True, "logit_bias": {"42": 100}}
    answer = _ok(cb_server.url, "/generate", {"prompt": "Hi", "generation_config": config})
    assert answer["choices"][0]["text"] == ":" * 5  # token 42 is ":"
    sampled = {
        "max_new_tokens": 4,
        "do_sample": True,
        "min_p": 0.1,
        "presence_penalty": 1.0,
        "frequency_penalty": -0.5,
        "seed": 1,
    }
    _ok(cb_server.url, "/generate", {"prompt": "Hi", "generation_config": sampled})


def test_the_openai_sdk_sends_them(cb_server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{cb_server.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": DEMO_QUESTION}],
        temperature=0,
        max_tokens=8,
        logit_bias={str(PARIS): -100},
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"min_p": 0.05},
    )
    assert "Paris" not in (chat.choices[0].message.content or "")


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias", "key 'abc' is not a token id"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias", "key '1.5' is not a token id"),
        ({"logit_bias": {"42": 200}}, "logit_bias", "between -100 and 100"),
        ({"logit_bias": {"42": "high"}}, "logit_bias", "must be a number"),
        ({"logit_bias": {"49157": 1}}, "logit_bias", "49157 is outside the vocabulary"),
        ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ],
)
def test_bad_values_are_400_naming_the_field(
    cb_server: ServerThread, gateway: ServerThread, fields: dict[str, Any], param: str, words: str
) -> None:
    for url in (cb_server.url, gateway.url):
        for path, body in (
            ("/v1/chat/completions", _chat(**fields)),
            ("/v1/completions", _completion(**fields)),
        ):
            answer = httpx.post(url + path, json=body, timeout=30)
            assert answer.status_code == 400, (url, path, answer.text)
            error = answer.json()["error"]
            assert error["param"] == param and words in error["message"], error


def test_native_errors_name_the_generation_config_field(cb_server: ServerThread) -> None:
    cases = [
        ({"logit_bias": {"abc": 1}}, "generation_config.logit_bias", "'abc'"),
        ({"presence_penalty": 3}, "generation_config.presence_penalty", "2"),
        ({"logit_bias": {"49157": 1}}, "logit_bias", "outside the vocabulary"),
    ]
    for config, param, words in cases:
        answer = httpx.post(
            f"{cb_server.url}/generate",
            json={"prompt": "Hi", "generation_config": config},
            timeout=30,
        )
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and words in error["message"], error


def test_beam_search_refuses_the_additive_knobs(cb_server: ServerThread) -> None:
    body = _completion(use_beam_search=True, n=2, logit_bias={"42": 1})
    answer = httpx.post(f"{cb_server.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 400
    assert "'logit_bias' is not supported with beam search" in answer.json()["error"]["message"]
