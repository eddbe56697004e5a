"""Structured output through the gateway with the ``openai`` SDK: ``response_format``
``json_schema`` and ``json_object`` on the CB server, whose output always parses and validates
against the schema (the engine masks every step's logits by the schema's grammar)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from harness.servers import ServerThread
from tests.support.default_model import MODEL_ID

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a user of a web site as JSON."}]


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}


def _ask(client: Any, **options: Any) -> Any:
    """The chat completion of ``ASK`` with ``options``."""
    return client.chat.completions.create(model=MODEL_ID, messages=ASK, **options)


def test_json_schema_output_validates(client: Any) -> None:
    answer = _ask(client, max_tokens=160, temperature=0, response_format=_json_schema(PERSON))
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_streamed_and_sampled_outputs_validate(client: Any) -> None:
    person = _json_schema(PERSON)
    chunks = _ask(client, max_tokens=160, temperature=0, stream=True, response_format=person)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    # n samples: each sequence follows the grammar on its own.
    sampled = _ask(client, max_tokens=160, n=2, temperature=1.0, seed=7, response_format=person)
    for choice in sampled.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_and_completions(client: Any) -> None:
    options = {"response_format": {"type": "json_object"}, "extra_body": {"min_tokens": 0}}
    answer = _ask(client, max_tokens=48, temperature=0, **options)
    text = answer.choices[0].message.content
    if answer.choices[0].finish_reason == "stop":  # a whole object within the budget
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert text.startswith("{")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    completion = client.completions.create(
        model=MODEL_ID,
        prompt="Is the sky blue? Answer as JSON:",
        max_tokens=32,
        temperature=0,
        extra_body={"response_format": _json_schema(schema)},
    )
    assert completion.choices[0].finish_reason == "stop", completion.choices[0]
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


def test_a_schema_that_cannot_compile_is_a_400(client: Any) -> None:
    bad = {"type": "object", "properties": {"x": {"type": "integer", "minimum": "low"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(client, max_tokens=8, response_format=_json_schema(bad))
    assert "response_format" in refused.value.message or "schema" in refused.value.message
    with pytest.raises(openai.BadRequestError, match="response_format"):
        _ask(client, max_tokens=8, response_format={"type": "xml"})
    with pytest.raises(openai.BadRequestError, match="beam search"):
        beams = {"n": 2, "extra_body": {"use_beam_search": True}}
        _ask(client, max_tokens=8, response_format=_json_schema(PERSON), **beams)


def test_the_static_batching_server_says_it_cannot(sb_server: ServerThread) -> None:
    body = {"messages": ASK, "max_tokens": 8, "response_format": {"type": "json_object"}}
    answer = sb_server.http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "response_format" and "continuous-batching" in error["message"]


# -- vLLM's structured_outputs and its older guided_* names ------------------------------------

PHONE = r"[0-9]{3}-[0-9]{4}"
CITIES = ["Paris", "London", "Berlin"]


def _completion_text(client: Any, prompt: str, **extra: Any) -> str:
    answer = client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=16, temperature=0, extra_body=extra
    )
    assert answer.choices[0].finish_reason == "stop", answer.choices[0]
    return answer.choices[0].text


def test_regex_choice_and_grammar_hold_on_both_routes(client: Any) -> None:
    regex = {"structured_outputs": {"regex": PHONE}}
    assert re.fullmatch(PHONE, _completion_text(client, "Call me at", **regex))
    assert re.fullmatch(PHONE, _completion_text(client, "Call me at", guided_regex=PHONE))
    asked = [{"role": "user", "content": "Which city is the capital of France?"}]
    for extra in ({"guided_choice": CITIES}, {"structured_outputs": {"choice": CITIES}}):
        answer = client.chat.completions.create(
            model=MODEL_ID, messages=asked, max_tokens=8, temperature=0, extra_body=extra
        )
        assert answer.choices[0].message.content in CITIES
    # A GBNF grammar (llama.cpp's syntax) and a Lark one, sampled: every sample is a sentence.
    gbnf = 'root ::= ("yes" | "no") ("," ("yes" | "no"))?'
    lark = 'start: ("a" | "b") ("a" | "b")? "!"'
    for grammar, valid in ((gbnf, r"(yes|no)(,(yes|no))?"), (lark, r"[ab]{1,2}!")):
        answer = client.completions.create(
            model=MODEL_ID, prompt="Well:", max_tokens=16, temperature=1.0, seed=3, n=3,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )  # fmt: skip
        for choice in answer.choices:
            assert choice.finish_reason == "stop" and re.fullmatch(valid, choice.text), choice


def test_guided_json_and_a_json_text_schema(client: Any, gateway: ServerThread) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"enum": CITIES}, "ok": {"type": "boolean"}},
        "required": ["city", "ok"],
        "additionalProperties": False,
    }
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        text = _completion_text(client, "Capital of France as JSON:", **extra)
        jsonschema.validate(json.loads(text), schema)
    config = {"max_new_tokens": 24, "structured_outputs": {"json": schema}}
    body = {"prompt": "Capital of France as JSON:", "generation_config": config}
    native = gateway.http.post("/generate", json=body, timeout=60)
    assert native.status_code == 200, native.text
    jsonschema.validate(json.loads(native.json()["choices"][0]["text"]), schema)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"guided_regex": "[a-z]", "guided_choice": ["a"]}, "'guided_regex', 'guided_choice'"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "'response_format', 'structured_outputs'",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "'regex', 'choice'"),
        ({"structured_outputs": {}}, "got none"),
        ({"structured_outputs": {"regex": "(["}}, "regex cannot be compiled"),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "grammar cannot be compiled"),
        ({"structured_outputs": {"pattern": "a"}}, "pattern"),
        ({"structured_outputs": {"json": {}, "whitespace_pattern": " "}}, "whitespace_pattern"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag"),
    ],
)
def test_bad_constraints_are_400s_naming_the_problem(
    gateway: ServerThread, extra: dict[str, Any], named: str
) -> None:
    body = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 4, **extra}
    answer = gateway.http.post("/v1/completions", json=body)
    assert answer.status_code == 400, answer.text
    assert named in answer.json()["error"]["message"]


def test_a_forced_tool_call_takes_no_second_constraint(gateway: ServerThread) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "model": MODEL_ID,
        "messages": ASK,
        "tools": [tool],
        "tool_choice": "required",
        "structured_outputs": {"regex": "a"},
    }
    answer = gateway.http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tool_choice"


def test_the_static_batching_server_refuses_structured_outputs(sb_server: ServerThread) -> None:
    body = {"prompt": "Hi", "max_tokens": 4, "guided_regex": "[a-z]+"}
    answer = sb_server.http.post("/v1/completions", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "structured_outputs" and "continuous-batching" in error["message"]
