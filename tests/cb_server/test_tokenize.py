"""``POST /tokenize`` and ``/detokenize`` in vLLM's shapes, on the CB and SB servers and through
the gateway: the ids equal the tokenizer's (and a chat completion's own prompt count), and bad
bodies get a 400 naming the problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from harness.servers import ServerThread
from tests.support.default_model import MODEL_ID

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(params=["cb_server", "gateway", "sb_server"])
def base_url(request: pytest.FixtureRequest) -> str:
    server: ServerThread = request.getfixturevalue(request.param)
    return server.url


def _post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=60)


def test_a_prompt_tokenizes_as_the_tokenizer_does(base_url: str, tokenizer: Any) -> None:
    text = "Grüße aus Paris 🚀"
    answer = _post(
        base_url, "/tokenize", {"model": MODEL_ID, "prompt": text, "return_token_strs": True}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = tokenizer.encode(text)
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    assert body["max_model_len"] > len(expected)
    back = _post(base_url, "/detokenize", {"model": MODEL_ID, "tokens": expected})
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(expected)}


def test_a_conversation_tokenizes_as_the_template_renders(base_url: str, tokenizer: Any) -> None:
    answer = _post(base_url, "/tokenize", {"messages": MESSAGES})
    assert answer.status_code == 200, answer.text
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert answer.json()["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
    assert answer.json()["token_strs"] is None
    bare = _post(base_url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert len(bare.json()["tokens"]) < len(answer.json()["tokens"])


def test_the_count_is_what_a_chat_completion_feeds_the_model(gateway: ServerThread) -> None:
    counted = _post(gateway.url, "/tokenize", {"model": MODEL_ID, "messages": MESSAGES}).json()
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=1)
    assert chat.usage is not None and chat.usage.prompt_tokens == counted["count"]


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "exactly one of prompt"),
        ("/tokenize", {}, "exactly one of prompt"),
        ("/tokenize", {"prompt": "a", "truncate": 3}, "truncate"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "cannot both"),
        ("/detokenize", {"tokens": [1, 10**9]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_bodies_get_a_400_naming_the_problem(
    base_url: str, path: str, body: dict[str, Any], named: str
) -> None:
    answer = _post(base_url, path, body)
    assert answer.status_code == 400, answer.text
    assert named in answer.json()["error"]["message"]


def test_an_unknown_model_is_refused(cb_server: ServerThread) -> None:
    answer = _post(cb_server.url, "/tokenize", {"model": "no-such-model", "prompt": "a"})
    assert answer.status_code == 404 and "no-such-model" in answer.text
