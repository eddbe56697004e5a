"""OpenAI's Responses API on the servers with the ``openai`` SDK's ``client.responses``: whole
and streamed answers (the events in order, the final response the same as the whole one), a
second turn through ``previous_response_id``, stored answers retrieved (and ``store: false``
ones not), function calls and their results in an agent loop, and the 4xx answers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from harness.servers import ServerThread
from tests.cb_server.test_tool_calls_server import TOOLS
from tests.support.default_model import MODEL_ID

FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]
ASK = "What is the capital of France?"


@pytest.fixture(scope="module")
def sdk(cb_server: ServerThread) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{cb_server.url}/v1", api_key="x", max_retries=0, timeout=60)
    yield client
    client.close()


def _create(client: openai.OpenAI, **options: Any) -> Any:
    options.setdefault("max_output_tokens", 32)
    return client.responses.create(model=MODEL_ID, temperature=0, **options)


def test_whole_then_a_second_turn_then_retrieved(sdk: openai.OpenAI) -> None:
    first = _create(sdk, input=ASK)
    assert first.status == "completed" and "Paris" in first.output_text
    assert first.usage.output_tokens > 0 and first.id.startswith("resp_")
    second = _create(sdk, input="And the capital of Italy?", previous_response_id=first.id)
    assert "Rome" in second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn came along
    assert sdk.responses.retrieve(first.id).output_text == first.output_text
    unstored = _create(sdk, input=ASK, store=False)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|not stored"):
        _create(sdk, input="Hi", previous_response_id=unstored.id)


def test_streamed_events_build_the_same_response(sdk: openai.OpenAI) -> None:
    whole = _create(sdk, input=ASK, instructions="You are a geography teacher.")
    events = list(_create(sdk, input=ASK, instructions="You are a geography teacher.", stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    end = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        end,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    with sdk.responses.stream(model=MODEL_ID, input=ASK, temperature=0) as stream:
        final = stream.get_final_response()
    assert "Paris" in final.output_text


def test_function_calls_and_an_agent_loop(sdk: openai.OpenAI) -> None:
    asked = "What is the weather in Paris?"
    called = _create(
        sdk, input=asked, tools=FUNCTIONS, tool_choice="required", max_output_tokens=96
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and all(c.call_id.startswith("call_") for c in calls)
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] == "Paris"
    streamed = list(
        _create(sdk, input=asked, tools=FUNCTIONS, tool_choice="required", max_output_tokens=96,
                stream=True)
    )  # fmt: skip
    arguments: dict[str, str] = {}
    for event in streamed:
        if event.type == "response.function_call_arguments.delta":
            arguments[event.item_id] = arguments.get(event.item_id, "") + event.delta
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [(i.name, json.loads(arguments[i.id])) for i in done] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]
    # The loop: each call's result goes back; the model answers in text.
    results = [
        {"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"c": 21})}
        for c in calls
    ]
    answer = _create(sdk, input=results, previous_response_id=called.id, tools=FUNCTIONS)
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]


def test_bad_requests_are_4xx_naming_the_problem(cb_server: ServerThread) -> None:
    cases = [
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "'web_search'"),
        ({"input": "Hi", "service_tier": "flex"}, 400, "service_tier"),
        ({"input": "Hi", "previous_response_id": "resp_nope"}, 404, "resp_nope"),
        ({"input": [{"type": "image", "url": "x"}]}, 400, "input"),
    ]
    for body, status, named in cases:
        answer = cb_server.http.post("/v1/responses", json={"model": MODEL_ID, **body})
        assert answer.status_code == status and named in answer.text, answer.text


def test_the_static_batching_server_answers_too(sb_server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{sb_server.url}/v1", api_key="x", max_retries=0)
    answer = client.responses.create(input=ASK, model=MODEL_ID, temperature=0)
    assert "Paris" in answer.output_text


@pytest.fixture(scope="module")
def two_servers_gateway(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: Any, cb_runner: Any
) -> Iterator[tuple[ServerThread, list[ServerThread]]]:
    """A gateway over two CB servers (round robin), each with its own stored answers."""
    from harness.servers import gateway_served
    from server.common.app import create_server_app
    from server.common.service import ServingSettings
    from server.continuous_batching.async_engine import AsyncEngine
    from server.continuous_batching.engine import LLMEngine
    from tests.support.default_model import engine_config

    servers = []
    for _ in range(2):
        engine = LLMEngine(engine_config(default_model_path, num_blocks=64), runner=cb_runner)
        settings = ServingSettings(served_model_names=[MODEL_ID])
        app = create_server_app(AsyncEngine(engine, MODEL_ID), settings)
        servers.append(ServerThread(app).start(timeout_seconds=60))
    folder = tmp_path_factory.mktemp("responses_gateway")
    urls = [server.url for server in servers]
    gateways = gateway_served(
        folder, continuous_batching_server_urls=urls, balancing_policy="round_robin"
    )
    yield next(gateways), servers
    next(gateways, None)
    for server in servers:
        server.stop()


def test_through_the_gateway_each_turn_goes_where_the_last_is_stored(
    two_servers_gateway: tuple[ServerThread, list[ServerThread]],
) -> None:
    gateway, servers = two_servers_gateway
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    answer = _create(client, input=ASK)
    for turn in range(4):  # round robin alone would alternate servers and lose the thread
        stream = turn % 2 == 1
        options = {"input": f"Say {turn}.", "previous_response_id": answer.id}
        if stream:
            events = list(_create(client, stream=True, **options))
            answer = events[-1].response
        else:
            answer = _create(client, **options)
        assert answer.status in ("completed", "incomplete")
    held = [s for s in servers if s.http.get(f"/v1/responses/{answer.id}").status_code == 200]
    assert len(held) == 1  # every turn went to the server holding the conversation
