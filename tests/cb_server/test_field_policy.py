"""An OpenAI body's undeclared fields: refused with a 400 naming them (the default, as OpenAI
answers), or with ``serving_config.unknown_fields: warn`` answered without them and named in
the log and the ``X-Unknown-Fields`` header. Through the gateway, which forwards bodies as
sent, and with the ``openai`` SDK's ``extra_body``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from harness.servers import ServerThread
from server.common.app import create_server_app
from server.common.service import ServingSettings
from server.continuous_batching.async_engine import AsyncEngine
from server.continuous_batching.engine import LLMEngine
from tests.support.default_model import MODEL_ID, engine_config

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TAG = (
    '{"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "object"}, '
    '"end": "</f>"}], "triggers": ["<f>"]}'
)
#: Every field of vLLM's ChatCompletionRequest (and OpenAI's), each with a value and what it
#: gets: 200 (honoured; what it does is tested beside its feature) or 400 naming it. Values
#: that need a companion field carry it. ``continuous_usage_stats`` lives in stream_options.
CHAT_FIELDS: dict[str, tuple[dict[str, Any], int]] = {
    "frequency_penalty": ({"frequency_penalty": 0.5}, 200),
    "logit_bias": ({"logit_bias": {"1": -1}}, 200),
    "logprobs": ({"logprobs": True}, 200),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, 200),
    "max_tokens": ({"max_tokens": 2}, 200),
    "max_completion_tokens": ({"max_completion_tokens": 2}, 200),
    "n": ({"n": 2, "temperature": 1.0}, 200),
    "presence_penalty": ({"presence_penalty": 0.5}, 200),
    "response_format": ({"response_format": {"type": "json_object"}}, 200),
    "seed": ({"seed": 1, "temperature": 1.0}, 200),
    "stop": ({"stop": ["x"]}, 200),
    "stream": ({"stream": True}, 200),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, 200),
    "temperature": ({"temperature": 0.5}, 200),
    "top_p": ({"top_p": 0.9, "temperature": 1.0}, 200),
    "tools": ({"tools": [TOOL]}, 200),
    "tool_choice": ({"tools": [TOOL], "tool_choice": "none"}, 200),
    "reasoning_effort": ({"reasoning_effort": "low"}, 200),
    "include_reasoning": ({"include_reasoning": False}, 200),
    "parallel_tool_calls": ({"tools": [TOOL], "parallel_tool_calls": False}, 200),
    "user": ({"user": "u"}, 200),
    "best_of": ({"best_of": 2, "use_beam_search": True}, 200),
    "use_beam_search": ({"use_beam_search": True, "n": 2}, 200),
    "top_k": ({"top_k": 5, "temperature": 1.0}, 200),
    "min_p": ({"min_p": 0.1, "temperature": 1.0}, 200),
    "repetition_penalty": ({"repetition_penalty": 1.1}, 200),
    "length_penalty": ({"length_penalty": 0.5, "use_beam_search": True, "n": 2}, 200),
    "stop_token_ids": ({"stop_token_ids": [2]}, 200),
    "include_stop_str_in_output": ({"include_stop_str_in_output": True}, 200),
    "ignore_eos": ({"ignore_eos": True}, 200),
    "min_tokens": ({"min_tokens": 1}, 200),
    "skip_special_tokens": ({"skip_special_tokens": False}, 200),
    "spaces_between_special_tokens": ({"spaces_between_special_tokens": True}, 200),
    "truncate_prompt_tokens": ({"truncate_prompt_tokens": 4}, 200),
    "prompt_logprobs": ({"prompt_logprobs": 1}, 200),
    "allowed_token_ids": ({"allowed_token_ids": [1, 2, 3]}, 200),
    "bad_words": ({"bad_words": ["x"]}, 200),
    "add_generation_prompt": ({"add_generation_prompt": True}, 200),
    "continue_final_message": (
        {
            "continue_final_message": True,
            "add_generation_prompt": False,
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello, I"},
            ],
        },
        200,
    ),
    "add_special_tokens": ({"add_special_tokens": True}, 200),
    "documents": ({"documents": [{"title": "a", "text": "b"}]}, 200),
    "chat_template_kwargs": ({"chat_template_kwargs": {"enable_thinking": False}}, 200),
    "guided_json": ({"guided_json": {"type": "object"}}, 200),
    "guided_regex": ({"guided_regex": "[a-z]+"}, 200),
    "guided_choice": ({"guided_choice": ["a", "b"]}, 200),
    "guided_grammar": ({"guided_grammar": 'root ::= "a"'}, 200),
    "structural_tag": ({"structural_tag": TAG}, 200),
    "guided_decoding_backend": ({"guided_decoding_backend": "auto"}, 200),
    "priority": ({"priority": 1}, 200),
    "structured_outputs": ({"structured_outputs": {"regex": "[a-z]+"}}, 200),
    "return_token_ids": ({"return_token_ids": True}, 200),
    # Refused, by name.
    "echo": ({"echo": True}, 400),
    "spaces_between_special_tokens=false": ({"spaces_between_special_tokens": False}, 400),
    "chat_template": ({"chat_template": "{{ messages }}"}, 400),
    "mm_processor_kwargs": ({"mm_processor_kwargs": {}}, 400),
    "guided_whitespace_pattern": ({"guided_whitespace_pattern": " "}, 400),
    "guided_decoding_backend=xgrammar": ({"guided_decoding_backend": "xgrammar"}, 400),
    "request_id": ({"request_id": "r1"}, 400),
    "logits_processors": ({"logits_processors": ["m.P"]}, 400),
    "return_tokens_as_token_ids": ({"return_tokens_as_token_ids": True}, 400),
    "cache_salt": ({"cache_salt": "abc"}, 400),
    "kv_transfer_params": ({"kv_transfer_params": {}}, 400),
    "vllm_xargs": ({"vllm_xargs": {"a": 1}}, 400),
    "thinking_token_budget": ({"thinking_token_budget": 8}, 400),
}
#: vLLM's CompletionRequest: the chat fields that apply to a prompt, and its own.
COMPLETION_FIELDS: dict[str, tuple[dict[str, Any], int]] = {
    **{
        name: outcome
        for name, outcome in CHAT_FIELDS.items()
        if name
        not in {
            "top_logprobs",
            "max_completion_tokens",
            "tools",
            "tool_choice",
            "reasoning_effort",
            "include_reasoning",
            "parallel_tool_calls",
            "logprobs",
            "add_generation_prompt",
            "continue_final_message",
            "documents",
            "chat_template_kwargs",
            "echo",
            "chat_template",
        }
    },  # fmt: skip
    "logprobs": ({"logprobs": 2}, 200),
    "echo": ({"echo": True}, 200),
    "add_special_tokens": ({"add_special_tokens": False}, 200),
    "suffix": ({"suffix": "x"}, 400),
    "prompt_embeds": ({"prompt_embeds": "AAAA"}, 400),
    "tools": ({"tools": [TOOL]}, 400),
}
CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def warn_server(default_model_path, cb_runner) -> Iterator[ServerThread]:
    engine = LLMEngine(engine_config(default_model_path, num_blocks=64), runner=cb_runner)
    settings = ServingSettings(served_model_names=[MODEL_ID], unknown_fields="warn")
    server = ServerThread(create_server_app(AsyncEngine(engine, MODEL_ID), settings))
    yield server.start(timeout_seconds=60)
    server.stop()


def _check_outcome(
    server: ServerThread, path: str, body: dict[str, Any], case: str, expected: Any
) -> None:
    sent, status = expected
    answer = httpx.post(f"{server.url}{path}", json={**body, **sent}, timeout=60)
    assert answer.status_code == status, answer.text
    if status == 400:
        assert f"'{case.split('=')[0]}'" in answer.json()["error"]["message"], answer.text


@pytest.mark.parametrize("case", CHAT_FIELDS)
def test_every_vllm_chat_field_is_honoured_or_refused_by_name(
    gateway: ServerThread, case: str
) -> None:
    _check_outcome(gateway, "/v1/chat/completions", CHAT, case, CHAT_FIELDS[case])


@pytest.mark.parametrize("case", COMPLETION_FIELDS)
def test_every_vllm_completion_field_is_honoured_or_refused_by_name(
    gateway: ServerThread, case: str
) -> None:
    _check_outcome(gateway, "/v1/completions", COMPLETION, case, COMPLETION_FIELDS[case])


def test_several_unknown_fields_and_a_nested_one_are_all_named(cb_server: ServerThread) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True},
            "foo": 1, "bar": 2}  # fmt: skip
    answer = httpx.post(f"{cb_server.url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "unknown fields 'bar', 'foo', 'stream_options.continuous_usage_stats'" in message


def test_the_sdk_learns_of_an_extra_body_field_it_sent(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="vllm_xargs"):
        client.chat.completions.create(
            model=MODEL_ID, messages=CHAT["messages"], extra_body={"vllm_xargs": {"a": 1}}
        )


def test_warn_answers_without_them_and_names_them(warn_server: ServerThread) -> None:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        plain = httpx.post(f"{warn_server.url}{path}", json={**body, "temperature": 0}, timeout=60)
        extras = {"vllm_xargs": {"a": 1}, "cache_salt": "x"}
        sent = {**body, "temperature": 0, **extras}
        answer = httpx.post(f"{warn_server.url}{path}", json=sent, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-Unknown-Fields"] == "cache_salt, vllm_xargs"
        assert "X-Unknown-Fields" not in plain.headers
        text = "message" if "chat" in path else "text"
        assert str(answer.json()["choices"][0][text]) == str(plain.json()["choices"][0][text])
    stream = {**CHAT, "stream": True, "top_beams": 2}
    with httpx.stream("POST", f"{warn_server.url}/v1/chat/completions", json=stream) as answer:
        assert answer.status_code == 200 and answer.headers["X-Unknown-Fields"] == "top_beams"
        assert "data: [DONE]" in answer.read().decode()
