"""Validation rules of the wire contract (no server needed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from protocol.generation import GenerateRequest, GenerationConfig
from protocol.openai_api import ChatCompletionRequest, CompletionRequest
from utils.errors import describe_validation_error


def _error_text(exc: ValidationError) -> str:
    return describe_validation_error(exc)[0]


def test_exactly_one_of_prompt_or_messages() -> None:
    with pytest.raises(ValidationError, match="exactly one of 'prompt' or 'messages'") as neither:
        GenerateRequest()
    assert "exactly one of 'prompt' or 'messages'" in _error_text(neither.value)
    with pytest.raises(ValidationError, match="exactly one of 'prompt' or 'messages'"):
        GenerateRequest(prompt="hi", messages=[{"role": "user", "content": "hi"}])
    assert GenerateRequest(prompt="hi").prompt == "hi"
    assert GenerateRequest(messages=[{"role": "user", "content": "hi"}]).messages


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"num_beams": 0}, "num_beams"),
    ],
)
def test_ranges_name_the_field(config: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=rf"generation_config\.{field}\b") as info:
        GenerateRequest(prompt="x", generation_config=config)
    message, param = describe_validation_error(info.value)
    assert param == f"generation_config.{field}"
    assert field in message


def test_min_must_not_exceed_max() -> None:
    with pytest.raises(ValidationError, match=r"min_new_tokens \(10\) must be <=") as info:
        GenerationConfig(min_new_tokens=10, max_new_tokens=5)
    assert "min_new_tokens (10) must be <= max_new_tokens (5)" in _error_text(info.value)


def test_return_sequences_bounded_by_beams() -> None:
    with pytest.raises(ValidationError, match=r"num_return_sequences \(3\) must be <=") as info:
        GenerationConfig(num_beams=2, num_return_sequences=3)
    assert "num_return_sequences (3) must be <= num_beams (2)" in _error_text(info.value)
    assert GenerationConfig(num_beams=4, num_return_sequences=3).num_workload_beams == 4
    with pytest.raises(ValidationError, match="would return identical copies"):
        GenerationConfig(num_return_sequences=2)  # greedy copies would be identical
    assert GenerationConfig(do_sample=True, num_return_sequences=2).num_workload_beams == 2


def test_unknown_generation_key_is_refused() -> None:
    with pytest.raises(
        ValidationError, match=r"max_tokens\n\s+Extra inputs are not permitted"
    ) as info:
        GenerationConfig.model_validate({"max_tokens": 5})
    assert "max_tokens" in _error_text(info.value)


def test_temperature_zero_means_greedy_and_stop_accepts_a_string() -> None:
    config = GenerationConfig(do_sample=True, temperature=0.0, stop="\n")
    assert config.do_sample is False
    assert config.stop == ["\n"]


def test_openai_chat_maps_to_generation_config() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "stop": "END",
            # vLLM extras are accepted, unknown OpenAI fields ignored.
            "top_k": 20,
            "min_tokens": 2,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "store": False,
        }
    )
    config = body.to_generation_config()
    assert config.max_new_tokens == 7
    assert config.do_sample and config.temperature == 0.5 and config.top_p == 0.9
    assert config.top_k == 20 and config.min_new_tokens == 2
    assert config.repetition_penalty == 1.1 and config.ignore_eos and config.seed == 3
    assert config.stop == ["END"]


def test_openai_defaults_sample_at_temperature_one_and_zero_is_greedy() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(chat).to_generation_config().do_sample
    greedy = ChatCompletionRequest.model_validate({**chat, "temperature": 0})
    assert not greedy.to_generation_config().do_sample


def test_openai_beam_search_and_unsupported_fields() -> None:
    body = CompletionRequest(prompt="x", n=2, best_of=3, use_beam_search=True, temperature=0)
    config = body.to_generation_config()
    assert config.num_beams == 3 and config.num_return_sequences == 2
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools)
    assert chat.forced_function is None and chat.active_tools[0]["function"]["name"] == "f"
    assert chat.to_generate_request() is None  # the native API has no tools
    with pytest.raises(ValidationError, match="not among the tools"):
        ChatCompletionRequest(
            messages=[{"role": "user", "content": "x"}],
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "g"}},
        )


def test_completion_prompt_forms() -> None:
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


def test_openai_knobs_map_to_the_native_names() -> None:
    body = CompletionRequest.model_validate_json(
        '{"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "min_p": 0.05,'
        ' "logit_bias": {"50256": -100, "7": 2.5}}'
    )
    config = body.to_generation_config()
    assert (config.presence_penalty, config.frequency_penalty, config.min_p) == (0.5, -1.0, 0.05)
    assert config.logit_bias == {50256: -100.0, 7: 2.5}
    unset = CompletionRequest(prompt="x", presence_penalty=None, logit_bias=None)
    assert unset.to_generation_config().logit_bias == {}
    native = GenerationConfig.model_validate({"logit_bias": {"3": 1, 4: -2}, "min_p": 1})
    assert native.logit_bias == {3: 1.0, 4: -2.0} and native.min_p == 1.0


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias", "key 'abc' is not a token id"),
        ({"logit_bias": {"-3": 1}}, "logit_bias", "key '-3' is not a token id"),
        ({"logit_bias": {" 3": 1}}, "logit_bias", "key ' 3' is not a token id"),
        ({"logit_bias": {"3": 100.5}}, "logit_bias", "between -100 and 100"),
        ({"logit_bias": {"3": True}}, "logit_bias", "must be a number"),
        ({"logit_bias": [3]}, "logit_bias", "Input should be a valid"),
        ({"presence_penalty": 2.01}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
        ({"min_p": -0.1}, "min_p", "greater than or equal to 0"),
    ],
)
def test_openai_knob_errors_name_the_field(fields: dict, param: str, words: str) -> None:
    for model in (CompletionRequest, ChatCompletionRequest):
        body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], **fields}
        with pytest.raises(ValidationError) as info:
            model.model_validate(body)
        message, named = describe_validation_error(info.value)
        assert named == param and words in message, message
    with pytest.raises(ValidationError) as native:
        GenerateRequest(prompt="x", generation_config=fields)
    message, named = describe_validation_error(native.value)
    assert named == f"generation_config.{param}" and words in message, message


def test_beam_search_refuses_the_additive_knobs() -> None:
    for name, value in [
        ("presence_penalty", 0.5),
        ("frequency_penalty", 1),
        ("logit_bias", {1: 1}),
    ]:
        with pytest.raises(ValidationError, match=f"'{name}' is not supported with beam search"):
            GenerationConfig(num_beams=2, **{name: value})
    # min_p is a sampling knob: beam search ignores it, as it ignores top_p.
    assert GenerationConfig(num_beams=2, min_p=0.5).is_beam_search
