"""Reasoning split out of chat answers on a thinking chat template (the default model's weights
behind a DeepSeek-R1/Qwen3-style template: the prompt opens ``<think>``, and
``enable_thinking: false`` closes an empty one): ``reasoning_content`` and ``content``, whole
and streamed through the ``openai`` SDK, ``include_reasoning``, ``reasoning_effort`` reaching
the template, and a server whose parser is off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from harness.servers import ServerThread
from server.common.app import create_server_app
from server.common.service import ServingSettings
from server.continuous_batching.async_engine import AsyncEngine
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import MODEL_ID, engine_config

THINKING_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if reasoning_effort is defined %}(effort: {{ reasoning_effort }})\n{%- endif %}"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}"
)
ASK = [{"role": "user", "content": "What is the capital of France?"}]
#: A thought, its end, then an answer: what a thinking model writes (forced, to be exact).
SHAPE = {"regex": "[A-Za-z ,]{1,30}</think>\n\n[A-Za-z ,]{1,30}"}


def _server(default_model_path: Path, runner: ModelRunner, parser: str) -> ServerThread:
    engine = LLMEngine(engine_config(default_model_path, num_blocks=64), runner=runner)
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    settings = ServingSettings(served_model_names=[MODEL_ID], reasoning_parser=parser)  # type: ignore[arg-type]
    return ServerThread(create_server_app(AsyncEngine(engine, MODEL_ID), settings))


@pytest.fixture(scope="module")
def thinking(default_model_path: Path, cb_runner: ModelRunner) -> Iterator[openai.OpenAI]:
    server = _server(default_model_path, cb_runner, "auto").start(timeout_seconds=60)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    yield client
    client.close()
    server.stop()


def _ask(client: openai.OpenAI, **options: Any) -> Any:
    options.setdefault("max_tokens", 40)
    return client.chat.completions.create(model=MODEL_ID, messages=ASK, temperature=0, **options)


def test_the_thought_is_split_out_whole_and_streamed(thinking: openai.OpenAI) -> None:
    answer = _ask(thinking, extra_body={"structured_outputs": SHAPE})
    message = answer.choices[0].message
    reasoning = (message.model_extra or {})["reasoning_content"]
    assert reasoning and "think>" not in reasoning
    assert message.content and "think>" not in message.content and message.content[0] != "\n"
    chunks = list(_ask(thinking, stream=True, extra_body={"structured_outputs": SHAPE}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    assert deltas[0].role == "assistant"


def test_an_unclosed_thought_is_all_reasoning_and_can_be_left_out(
    thinking: openai.OpenAI,
) -> None:
    # (This model would end at once after the open thought: min_tokens makes it think.)
    message = _ask(thinking, max_tokens=8, extra_body={"min_tokens": 6}).choices[0].message
    assert message.content is None and (message.model_extra or {})["reasoning_content"].strip()
    hidden = _ask(thinking, max_tokens=8, extra_body={"include_reasoning": False, "min_tokens": 6})
    assert "reasoning_content" not in (hidden.choices[0].message.model_extra or {})


def test_template_arguments_reach_the_template(
    thinking: openai.OpenAI, default_model_path: Path
) -> None:
    from transformers import AutoTokenizer

    # enable_thinking: false closes the thought in the prompt: the answer is all content.
    closed = {"chat_template_kwargs": {"enable_thinking": False}, "min_tokens": 4}
    message = _ask(thinking, max_tokens=6, extra_body=closed).choices[0].message
    assert message.content and "reasoning_content" not in (message.model_extra or {})
    effort = _ask(
        thinking, max_tokens=1, reasoning_effort="low", extra_body={"return_token_ids": True}
    )
    prompt = AutoTokenizer.from_pretrained(default_model_path).decode(
        (effort.model_extra or {})["prompt_token_ids"]
    )
    assert "(effort: low)" in prompt and prompt.endswith("<think>")


def test_a_server_without_the_parser_keeps_the_thought_in_the_content(
    default_model_path: Path, cb_runner: ModelRunner
) -> None:
    server = _server(default_model_path, cb_runner, "none").start(timeout_seconds=60)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        message = _ask(client, extra_body={"structured_outputs": SHAPE}).choices[0].message
        assert "</think>" in (message.content or "")
        assert "reasoning_content" not in (message.model_extra or {})
    finally:
        server.stop()


def test_the_responses_api_gives_the_thought_its_own_item(thinking: openai.OpenAI) -> None:
    # The prompt opens a thought that this model never closes: all of it is reasoning.
    answer = thinking.responses.create(
        model=MODEL_ID, input=ASK[0]["content"], temperature=0, max_output_tokens=24,
        text={"format": {"type": "json_object"}},
    )  # fmt: skip
    assert [item.type for item in answer.output] == ["reasoning"]
    assert answer.output[0].content[0].text.startswith("{") and answer.output_text == ""
    assert 0 < answer.usage.output_tokens_details.reasoning_tokens <= answer.usage.output_tokens
