"""What a clumsy or hostile client sends, against a real CB server and a gateway in front of
it: each answer is a 4xx in the error shape (never a 500), and never a silent wrong answer."""

from __future__ import annotations

import httpx
import pytest

from harness.servers import ServerThread
from tests.support.default_model import MODEL_ID


def _bodies(text_json: str) -> dict[str, bytes]:
    """A request per generation endpoint whose text is ``text_json`` (a JSON value, raw)."""
    return {
        "/generate": f'{{"prompt": {text_json}}}'.encode(),
        "/v1/completions": f'{{"model": "{MODEL_ID}", "prompt": {text_json}}}'.encode(),
        "/v1/chat/completions": (
            f'{{"model": "{MODEL_ID}", "messages": [{{"role": "user", "content": {text_json}}}]}}'
        ).encode(),
    }


def _assert_400(response: httpx.Response, expected: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and expected in error["message"], error


@pytest.mark.parametrize("text_json", ['"caf\\ud800e"', '"\\udc00"'])
def test_lone_surrogates_are_400(
    cb_server: ServerThread, gateway: ServerThread, text_json: str
) -> None:
    for url in (cb_server.url, gateway.url):
        for endpoint, body in _bodies(text_json).items():
            response = httpx.post(url + endpoint, content=body, timeout=30)
            _assert_400(response, "surrogate")


@pytest.mark.parametrize("depth", [5_000, 40_000])
def test_deeply_nested_json_is_400(
    cb_server: ServerThread, gateway: ServerThread, depth: int
) -> None:
    nested = "[" * depth + "]" * depth
    for url in (cb_server.url, gateway.url):
        for endpoint, body in _bodies(nested).items():
            response = httpx.post(url + endpoint, content=body, timeout=30)
            _assert_400(response, "recursion limit")


def test_a_vanishing_temperature_is_greedy(cb_server: ServerThread, gateway: ServerThread) -> None:
    prompt = "The capital of France is"

    def native(**config: object) -> str:
        body = {"prompt": prompt, "generation_config": {"max_new_tokens": 8, **config}}
        answer = httpx.post(f"{gateway.url}/generate", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]

    def completion(temperature: float) -> str:
        body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 8, "temperature": temperature}
        answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]

    greedy = native()
    assert greedy.strip()
    assert native(do_sample=True, temperature=1e-300) == greedy
    assert native(do_sample=True, temperature=1e-7, seed=3) == greedy
    assert completion(1e-300) == completion(0.0) == greedy


@pytest.mark.parametrize("token_id", [49_152 + 5, 10**30, -1])
def test_stop_token_ids_outside_the_vocabulary_are_400(
    cb_server: ServerThread, gateway: ServerThread, token_id: int
) -> None:
    native = {
        "prompt": "Hi",
        "generation_config": {"stop_token_ids": [2, token_id], "min_new_tokens": 2},
    }
    openai_body = {
        "model": MODEL_ID,
        "prompt": "Hi",
        "stop_token_ids": [token_id],
        "min_tokens": 2,
        "max_tokens": 4,
    }
    for url in (cb_server.url, gateway.url):
        for endpoint, body in (("/generate", native), ("/v1/completions", openai_body)):
            response = httpx.post(url + endpoint, json=body, timeout=30)
            _assert_400(response, f"stop_token_ids token id {token_id} is outside the vocabulary")
            assert response.json()["error"]["param"] == "stop_token_ids"
