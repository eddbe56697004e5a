"""vLLM's request extensions the servers honour, through the gateway with the ``openai`` SDK's
``extra_body``, on the CB and the SB server: ``include_stop_str_in_output``,
``skip_special_tokens``, ``truncate_prompt_tokens`` and ``allowed_token_ids``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from harness.servers import ServerThread
from tests.support.default_model import MODEL_ID

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
IM_START = 1  # <|im_start|>: a special token that ends nothing


@pytest.fixture(params=["gateway", "sb_gateway"])
def sdk(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    server: ServerThread = request.getfixturevalue(request.param)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    yield client
    client.close()


def _chat(sdk: openai.OpenAI, **extra: Any) -> tuple[str, str]:
    answer = sdk.chat.completions.create(
        model=MODEL_ID, messages=QUESTION, temperature=0, max_tokens=24, stop=["Paris"],
        extra_body=extra or None,
    )  # fmt: skip
    choice = answer.choices[0]
    return choice.message.content or "", choice.finish_reason


def test_the_stop_string_stays_when_asked(sdk: openai.OpenAI) -> None:
    cut, reason = _chat(sdk)
    kept, kept_reason = _chat(sdk, include_stop_str_in_output=True)
    assert reason == kept_reason == "stop"
    assert "Paris" not in cut and kept == cut + "Paris"


def test_special_tokens_text_when_not_skipped(sdk: openai.OpenAI) -> None:
    def complete(**extra: Any) -> str:
        answer = sdk.completions.create(
            model=MODEL_ID, prompt="Hi", max_tokens=1, temperature=0,
            logit_bias={str(IM_START): 100}, extra_body=extra or None,
        )  # fmt: skip
        return answer.choices[0].text

    assert complete() == ""
    assert complete(skip_special_tokens=False) == "<|im_start|>"


def test_truncate_prompt_tokens_keeps_the_prompts_end(sdk: openai.OpenAI, tokenizer: Any) -> None:
    text = "The capital of France is"
    ids = tokenizer.encode(text)
    options = {"model": MODEL_ID, "max_tokens": 4, "temperature": 0}
    cut = sdk.completions.create(prompt=text, extra_body={"truncate_prompt_tokens": 3}, **options)
    given = sdk.completions.create(prompt=ids[-3:], **options)
    assert cut.usage is not None and cut.usage.prompt_tokens == 3
    assert cut.choices[0].text == given.choices[0].text
    chat = sdk.chat.completions.create(
        model=MODEL_ID, messages=QUESTION, max_tokens=1, extra_body={"truncate_prompt_tokens": 5}
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        sdk.completions.create(prompt=text, extra_body={"truncate_prompt_tokens": 0}, **options)


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


def test_priority_runs_on_the_cb_server_and_the_sb_server_refuses_it(
    gateway: ServerThread, sb_gateway: ServerThread
) -> None:
    body = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2, "priority": -3}
    assert httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60).status_code == 200
    refused = httpx.post(f"{sb_gateway.url}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "'priority' is not supported by this static-batching server" in refused.text


def test_allowed_token_ids_limit_the_output(sdk: openai.OpenAI, tokenizer: Any) -> None:
    options = {"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 3}
    free = sdk.completions.create(temperature=0, **options).choices[0].text
    assert "London" not in free
    (london,) = tokenizer.encode(" London")
    (rome,) = tokenizer.encode(" Rome")
    only = sdk.completions.create(
        temperature=0, extra_body={"allowed_token_ids": [london]}, **options
    )
    assert only.choices[0].text == " London London London"
    sampled = sdk.completions.create(
        temperature=1.0, seed=7, extra_body={"allowed_token_ids": [london, rome]}, **options
    )
    words = sampled.choices[0].text.split()
    assert len(words) == 3 and set(words) <= {"London", "Rome"}
    chat = sdk.chat.completions.create(
        model=MODEL_ID, messages=QUESTION, max_tokens=2, temperature=0,
        extra_body={"allowed_token_ids": [rome]},
    )  # fmt: skip
    assert chat.choices[0].message.content == " Rome Rome"
    for bad in ([], [10**7]):
        with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
            sdk.completions.create(extra_body={"allowed_token_ids": bad}, **options)
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        sdk.completions.create(
            extra_body={"allowed_token_ids": [rome], "use_beam_search": True}, n=2, **options
        )


def test_bad_words_never_appear(sdk: openai.OpenAI) -> None:
    options = {"model": MODEL_ID, "prompt": "The capital of France is", "temperature": 0}
    free = sdk.completions.create(max_tokens=3, **options).choices[0].text
    assert free.startswith(" Paris")
    banned = sdk.completions.create(max_tokens=3, extra_body={"bad_words": ["Paris"]}, **options)
    assert "Paris" not in banned.choices[0].text
    # A word of several tokens: its first tokens may come, its last one never after them.
    chat = {"model": MODEL_ID, "messages": QUESTION, "temperature": 0, "max_tokens": 24}
    answer = sdk.chat.completions.create(**chat).choices[0].message.content or ""
    words = answer.split()
    pair = next(
        f"{a} {b}" for a, b in zip(words, words[1:], strict=False) if a.isalpha() and b.isalpha()
    )
    avoided = sdk.chat.completions.create(extra_body={"bad_words": [pair]}, **chat)
    text = avoided.choices[0].message.content or ""
    assert pair in answer and pair not in text
    assert text.split()[:1] == answer.split()[:1]  # the same until the ban bites
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        sdk.completions.create(max_tokens=2, extra_body={"bad_words": [" "]}, **options)


def test_return_token_ids_whole_and_streamed(sdk: openai.OpenAI, tokenizer: Any) -> None:
    prompt = "The capital of France is"
    options = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    plain = sdk.completions.create(**options).choices[0]
    assert "token_ids" not in (plain.model_extra or {})  # only when asked
    whole = sdk.completions.create(extra_body={"return_token_ids": True}, **options).choices[0]
    extra = whole.model_extra or {}
    assert extra["prompt_token_ids"] == tokenizer.encode(prompt)
    assert len(extra["token_ids"]) == 6 and tokenizer.decode(extra["token_ids"]) == whole.text
    chunks = list(
        sdk.completions.create(stream=True, extra_body={"return_token_ids": True}, **options)
    )
    firsts = [c.choices[0].model_extra or {} for c in chunks if c.choices]
    assert firsts[0]["prompt_token_ids"] == extra["prompt_token_ids"]
    assert all("prompt_token_ids" not in later for later in firsts[1:])
    assert [t for chunk in firsts for t in chunk["token_ids"]] == extra["token_ids"]

    chat = {"model": MODEL_ID, "messages": QUESTION, "max_tokens": 5, "temperature": 0}
    answer = sdk.chat.completions.create(extra_body={"return_token_ids": True}, **chat)
    prompt_ids = (answer.model_extra or {})["prompt_token_ids"]
    assert answer.usage is not None and len(prompt_ids) == answer.usage.prompt_tokens
    assert "What is the capital of France?" in tokenizer.decode(prompt_ids)
    ids = (answer.choices[0].model_extra or {})["token_ids"]
    assert tokenizer.decode(ids) == answer.choices[0].message.content
    streamed = list(
        sdk.chat.completions.create(stream=True, extra_body={"return_token_ids": True}, **chat)
    )
    assert (streamed[0].model_extra or {})["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in streamed[1:])
    pieces = [(c.choices[0].model_extra or {}).get("token_ids", []) for c in streamed if c.choices]
    assert [t for piece in pieces for t in piece] == ids
