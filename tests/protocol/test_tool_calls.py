"""Tool calls' text side: the fallback for templates without tools, the schema that constrains
a required or named call, and calls parsed out of the model's text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from server.common.tool_calls import (
    TOOL_CALL_OPEN,
    call_schema,
    fallback_conversation,
    parse_tool_calls,
)
from server.common.tool_syntax import HermesSyntax

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def test_the_fallback_teaches_a_template_without_tools(default_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    conversation: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    plain = tokenizer.apply_chat_template(conversation[:1], tokenize=False)
    # SmolLM2's template ignores tools: that is what the fallback is for.
    assert tokenizer.apply_chat_template(conversation[:1], tools=[WEATHER], tokenize=False) == plain
    text = tokenizer.apply_chat_template(
        fallback_conversation(conversation, [WEATHER]), tokenize=False
    )
    assert '"name": "get_weather"' in text and TOOL_CALL_OPEN in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert '<tool_response>{"temp": 21}</tool_response>' in text
    assert text.count("<|im_start|>system") == 1  # the tools join the system turn


def test_the_call_schema_accepts_calls_and_nothing_else() -> None:
    any_call = call_schema([WEATHER, TIME])
    jsonschema.validate({"name": "get_time", "arguments": {}}, any_call)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, any_call)
    named = call_schema([WEATHER, TIME], "get_weather")
    for bad in (
        {"name": "get_time", "arguments": {}},  # another function
        {"name": "get_weather", "arguments": {}},  # "city" is required
        {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "K"}},
        {"name": "get_weather"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, named)
    with pytest.raises(ValueError, match="not among the tools"):
        call_schema([WEATHER], "nope")


def test_calls_are_parsed_out_of_the_text() -> None:
    text = (
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    # Not JSON, or no call at all: the text stays text.
    assert parse_tool_calls("<tool_call>oops</tool_call>") == ("<tool_call>oops</tool_call>", [])
    assert parse_tool_calls("It is sunny.") == ("It is sunny.", [])
    # parallel_tool_calls: false: the first call alone; later calls are not made.
    content, calls = parse_tool_calls(text, is_parallel=False)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather"]


def test_the_forced_calls_grammar_takes_calls_and_nothing_else(default_model_path: Path) -> None:
    from server.common.structured_output import GrammarCompiler, OutputConstraint

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    compiler = GrammarCompiler(tokenizer, eos_token_ids=[tokenizer.eos_token_id])
    weather = '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>'
    time = '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'

    def accepts(grammar: str, text: str) -> bool:
        matcher = compiler.matcher(OutputConstraint("grammar", grammar))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept(t) for t in ids) and matcher._matcher.is_accepting()

    several = HermesSyntax().grammar([WEATHER, TIME], None, is_parallel=True)
    assert accepts(several, weather) and accepts(several, f"{weather}\n{time}")
    assert not accepts(several, "It is sunny.")
    one = HermesSyntax().grammar([WEATHER, TIME], None, is_parallel=False)
    assert accepts(one, time) and not accepts(one, f"{weather}\n{time}")
    named = HermesSyntax().grammar([WEATHER, TIME], "get_time", is_parallel=True)
    assert accepts(named, time) and not accepts(named, weather)


@pytest.mark.parametrize("syntax_name", ["llama3_json", "mistral"])
def test_the_other_syntaxes_force_calls_they_parse(
    default_model_path: Path, syntax_name: str
) -> None:
    from server.common.structured_output import GrammarCompiler, OutputConstraint
    from server.common.tool_syntax import SYNTAXES

    syntax = SYNTAXES[syntax_name]
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    compiler = GrammarCompiler(tokenizer, eos_token_ids=[tokenizer.eos_token_id])
    if syntax_name == "llama3_json":
        answer = (
            '{"name":"get_weather","parameters":{"city":"Oslo"}}; '
            '{"name":"get_time","parameters":{}}'
        )
    else:
        answer = (
            '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Oslo"}},'
            '{"name":"get_time","arguments":{}}]'
        )
    for is_parallel, is_valid in ((True, True), (False, False)):
        grammar = syntax.grammar([WEATHER, TIME], None, is_parallel=is_parallel)
        matcher = compiler.matcher(OutputConstraint("grammar", grammar))
        ids = tokenizer.encode(answer, add_special_tokens=False)
        accepted = all(matcher.accept(t) for t in ids) and matcher._matcher.is_accepting()
        assert accepted is is_valid
    content, calls = syntax.parse(answer)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
