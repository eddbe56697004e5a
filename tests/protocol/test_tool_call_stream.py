"""Tool calls read out of a stream (``ToolCallStream``): whatever pieces the text comes in,
the content and the calls the stream gives add up to what the whole text parses to, and a
name-first call's arguments come out as they are generated, before the block closes."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from server.common.tool_call_stream import ToolCallStream
from server.common.tool_calls import parse_tool_calls

TEXTS = [
    'Let me see. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "x": '
    '{"a": "}"}}}</tool_call>\n<tool_call>{"arguments": {"n": 1}, "name": "get_time"}'
    "</tool_call> Done.",
    '<tool_call>{"name":"f","arguments":{}}</tool_call>\n'
    '<tool_call>{"name":"g","arguments":{"q":"a\\"b}"}}</tool_call>',
    "No call here, only text with < and <tool_ but no block.",
    "  spaces around, no call  ",
    "<tool_call>not json</tool_call> so text",
    '<tool_call>{"name":"f","arguments":[1, 2]}</tool_call>',
    '<tool_call>{"name":"f","arguments":"a string"}</tool_call>',
]


def _streamed(text: str, cuts: list[int], is_parallel: bool) -> tuple[str, list[Any]]:
    """The content and calls (name, arguments text) a stream gives for ``text`` in pieces."""
    stream = ToolCallStream(is_parallel=is_parallel)
    content, calls = "", {}
    edges = [0, *cuts, len(text)]
    parts = [stream.feed(text[a:b]) for a, b in zip(edges, edges[1:], strict=False)]
    for part in [*parts, stream.finish()]:
        content += part.content
        for call in part.calls:
            entry = calls.setdefault(call.index, [None, ""])
            if call.id is not None:
                assert entry[0] is None and call.id.startswith("call_")  # opened once
                entry[0] = call.name
            entry[1] += call.arguments
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("is_parallel", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_any_pieces_add_up_to_the_whole_parse(text: str, is_parallel: bool) -> None:
    whole_content, whole_calls = parse_tool_calls(text, is_parallel=is_parallel)
    expected = [(c.name, json.loads(c.arguments)) for c in whole_calls]
    draw = random.Random(text)
    for _ in range(200):
        cuts = sorted(draw.sample(range(1, len(text)), draw.randint(0, min(16, len(text) - 1))))
        content, calls = _streamed(text, cuts, is_parallel)
        assert (content or None) == whole_content, cuts
        assert [(name, json.loads(arguments)) for name, arguments in calls] == expected, cuts


def test_arguments_stream_before_the_block_closes() -> None:
    stream = ToolCallStream()
    opened = stream.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert [(c.index, c.name, c.arguments) for c in opened.calls] == [(0, "get_weather", '{"ci')]
    more = stream.feed('ty": "Par')
    assert [(c.id, c.arguments) for c in more.calls] == [(None, 'ty": "Par')]
    end = stream.feed('is"}}</tool_call>')
    assert [c.arguments for c in end.calls] == ['is"}'] and stream.num_calls == 1
    assert stream.feed("\n").content == "" and stream.finish().content == ""


SYNTAX_TEXTS = {
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", '
        '"parameters": {}}',
        '<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}',
        "The weather is {unknown} today.",
        '  {"not": "a call"}',
    ],
    "mistral": [
        'Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "[TOOL_CALLS] not json",
        "No call, only [brackets].",
    ],
}


@pytest.mark.parametrize(
    ("syntax_name", "text"), [(n, t) for n, texts in SYNTAX_TEXTS.items() for t in texts]
)
def test_held_syntaxes_stream_content_then_the_whole_calls(syntax_name: str, text: str) -> None:
    from server.common.tool_syntax import SYNTAXES

    syntax = SYNTAXES[syntax_name]
    whole_content, whole_calls = syntax.parse(text)
    expected = [(c.name, json.loads(c.arguments)) for c in whole_calls]
    draw = random.Random(text)
    for _ in range(100):
        cuts = sorted(draw.sample(range(1, len(text)), draw.randint(0, min(12, len(text) - 1))))
        edges = [0, *cuts, len(text)]
        stream = syntax.stream()
        parts = [stream.feed(text[a:b]) for a, b in zip(edges, edges[1:], strict=False)]
        parts.append(stream.finish())
        content = "".join(p.content for p in parts)
        calls = [(c.name, json.loads(c.arguments)) for p in parts for c in p.calls]
        assert calls == expected and stream.num_calls == len(expected), cuts
        shown = (content.strip() or None) if expected else content
        assert shown == whole_content, cuts


def test_the_syntax_is_read_from_the_chat_template() -> None:
    from server.common.tool_syntax import syntax_for

    assert syntax_for("auto", "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert syntax_for("auto", "<tool_call>\n{{ tool_call }}").name == "hermes"
    llama = (
        'Respond in the format {"name": function name, "parameters": dictionary of argument name'
    )
    assert syntax_for("auto", llama).name == "llama3_json"
    assert syntax_for("auto", "{{ '<|python_tag|>' }}").name == "llama3_json"
    assert syntax_for("auto", None).name == "hermes"  # no template: the fallback prompt's
    assert syntax_for("mistral", "<tool_call>").name == "mistral"  # the setting wins
