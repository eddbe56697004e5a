"""Tool calls through the gateway with the ``openai`` SDK on the CB server: ``tools`` rendered
(SmolLM2's template knows none, so the documented fallback), ``tool_choice`` required or named
constrained to valid calls (several, or one with ``parallel_tool_calls: false``), calls in
OpenAI's ``tool_calls`` (streamed as OpenAI streams them: id and name, then argument
fragments), content streamed as it comes, and the ``role: tool`` answer taken back."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from harness.servers import ServerThread
from tests.support.default_model import MODEL_ID

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    assert name is None or call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def _ask_with_tools(client: Any, tool_choice: str | dict[str, Any], **options: Any) -> Any:
    """The chat completion of ``ASK`` offering ``TOOLS`` with ``tool_choice``."""
    return client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=tool_choice, **options
    )


def _streamed_calls(chunks: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """The calls a stream's tool-call deltas make, reassembled as the SDK does: by index, the
    id and name on the first delta, the arguments' text in fragments."""
    calls: dict[int, list[Any]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.index not in calls:
                assert delta.id.startswith("call_") and delta.function.name
                calls[delta.index] = [delta.function.name, ""]
            else:
                assert delta.id is None
            calls[delta.index][1] += delta.function.arguments or ""
    return [(name, json.loads(arguments)) for name, arguments in calls.values()]


def test_required_calls_are_valid_streamed_or_not(client: Any) -> None:
    """``required``: one call or more, each valid (two here, as the model chooses); the
    stream sends each call's arguments in fragments as they are generated."""
    answer = _ask_with_tools(client, "required", max_tokens=96, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 2 and len({call.id for call in calls}) == 2
    whole = [(call.function.name, _check_call(call)) for call in calls]
    chunks = list(_ask_with_tools(client, "required", max_tokens=96, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert _streamed_calls(chunks) == whole
    fragments = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(fragments) > len(whole)  # the arguments came in pieces, not whole at the end
    # parallel_tool_calls: false: exactly one call, streamed or not.
    one = _ask_with_tools(
        client, "required", max_tokens=96, temperature=0, parallel_tool_calls=False
    )
    assert [call.function.name for call in one.choices[0].message.tool_calls] == [whole[0][0]]
    chunks = list(
        _ask_with_tools(
            client, "required", max_tokens=96, temperature=0, parallel_tool_calls=False,
            stream=True,
        )
    )  # fmt: skip
    assert _streamed_calls(chunks) == whole[:1]


def test_auto_streams_content_as_it_comes(client: Any) -> None:
    options = {"max_tokens": 24, "temperature": 0}
    whole = _ask_with_tools(client, "auto", **options).choices[0]
    chunks = list(_ask_with_tools(client, "auto", stream=True, **options))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1 and "".join(texts) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_a_named_function_and_the_round_trip(client: Any) -> None:
    get_time = {"type": "function", "function": {"name": "get_time"}}
    answer = _ask_with_tools(client, get_time, max_tokens=64, temperature=0)
    [call] = answer.choices[0].message.tool_calls
    arguments = _check_call(call, "get_time")
    # The call and its result go back; the model answers in text.
    history = [
        *ASK,
        answer.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"time": "14:05"})},
    ]
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=history, tools=TOOLS, tool_choice="none", max_tokens=16
    )
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    assert isinstance(arguments["city"], str)


def test_auto_and_none(client: Any) -> None:
    for choice_mode in ("auto", "none"):
        answer = _ask_with_tools(client, choice_mode, max_tokens=48, temperature=0)
        message = answer.choices[0].message
        for call in message.tool_calls or []:  # auto: the model may call, validly named
            assert choice_mode == "auto"
            assert call.function.name in {t["function"]["name"] for t in TOOLS}
        assert message.content or message.tool_calls


def test_bad_tool_choices_are_400s(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        _ask_with_tools(client, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs 'tools'"):
        client.chat.completions.create(model=MODEL_ID, messages=ASK, tool_choice="required")


def test_the_static_batching_server_takes_tools_but_cannot_force_a_call(
    sb_server: ServerThread,
) -> None:
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 8}
    assert sb_server.http.post("/v1/chat/completions", json=body).status_code == 200
    forced = sb_server.http.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert forced.status_code == 400 and "continuous-batching" in forced.json()["error"]["message"]


def test_a_server_set_to_llama3_json_calls(default_model_path: Any, cb_runner: Any) -> None:
    """``tool_call_parser: llama3_json``: a forced answer is Llama 3's JSON calls, read back
    into ``tool_calls`` whole and streamed (the calls whole at the end)."""
    from server.common.app import create_server_app
    from server.common.service import ServingSettings
    from server.continuous_batching.async_engine import AsyncEngine
    from server.continuous_batching.engine import LLMEngine
    from tests.support.default_model import engine_config

    engine = LLMEngine(engine_config(default_model_path, num_blocks=64), runner=cb_runner)
    settings = ServingSettings(served_model_names=[MODEL_ID], tool_call_parser="llama3_json")
    server = ServerThread(create_server_app(AsyncEngine(engine, MODEL_ID), settings))
    server.start(timeout_seconds=60)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        answer = _ask_with_tools(client, "required", max_tokens=96, temperature=0)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        whole = [(c.function.name, _check_call(c)) for c in choice.message.tool_calls]
        chunks = list(
            _ask_with_tools(client, "required", max_tokens=96, temperature=0, stream=True)
        )
        assert _streamed_calls(chunks) == whole
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        server.stop()
