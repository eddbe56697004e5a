"""A choice resumed on the static-batching server from the tokens another server streamed (the
gateway's mid-stream resume, ``protocol.resume``) continues as the undisturbed greedy run: the
same tokens and text, no character missing or repeated, the same finish reason, the resumed
tokens counting toward ``max_new_tokens``, ``min_new_tokens`` and the output penalties; resumed
rows of different lengths share a package; a choice with no token left is refused; and over
HTTP a completions stream resumed from its ``: tokens`` comments ends as the undisturbed one.

Seeded sampling is not checked: ``generate`` does not reproduce the first server's draws (see
``server.static_batching.rows``)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from harness.servers import ServerThread
from protocol.generation import GenerationConfig
from protocol.resume import STREAM_TOKENS_HEADER
from server.common.backend import SequenceRequest, TextDelta
from server.static_batching.backend import StaticBatchingBackend
from server.static_batching.worker import LoadedModel
from tests.sb_server.test_sb_packing import chat_ids, make_backend, packages
from tests.support.default_model import MODEL_ID
from utils.errors import APIError

pytestmark = pytest.mark.slow

__all__ = ["make_backend"]  # the fixture, imported for this module's tests


async def _run(backend: StaticBatchingBackend, request: SequenceRequest) -> list[TextDelta]:
    """Every delta of a one-choice request, in order."""
    deltas: list[TextDelta] = []
    async for step in backend.stream(request):
        assert all(delta.index == 0 for delta in step)
        deltas.extend(step)
    return deltas


def _resumed(
    name: str, prompt: list[int], config: GenerationConfig, streamed: list[TextDelta]
) -> SequenceRequest:
    """The request that finishes a stream broken after the deltas ``streamed``."""
    return SequenceRequest(
        name,
        prompt,
        config,
        resumed_token_ids=[t for d in streamed for t in d.token_ids],
        num_resumed_text_chars=sum(len(d.text) for d in streamed),
    )


def _switch_points(whole: list[TextDelta]) -> list[int]:
    """Where to break the stream (after that many deltas): the first, a middle one and the
    last but one (each delta carries at least one token)."""
    return sorted({1, len(whole) // 2, len(whole) - 1})


POEM = "Write a short poem about the sea."


@pytest.mark.parametrize(
    ("question", "options"),
    [
        (POEM, {"max_new_tokens": 12, "ignore_eos": True}),
        (POEM, {"max_new_tokens": 14, "presence_penalty": 1.2, "frequency_penalty": 0.4}),
        # Greedy ends with EOS as token 10; min_tokens 10 bans it, and EOS ends token 17.
        ("Hi", {"max_new_tokens": 24, "min_new_tokens": 10}),
    ],
    ids=["greedy", "penalties", "min_tokens"],
)
async def test_a_resumed_choice_continues_the_undisturbed_one(
    make_backend: Any, sb_model: LoadedModel, question: str, options: dict[str, Any]
) -> None:
    """Broken after the first, a middle and the last but one delta, then resumed: the three
    resumed requests (inputs of different lengths) run in one package and each gives the rest
    of the undisturbed run's tokens and text, and its finish reason."""
    backend = await make_backend(interval=0.3)
    prompt = chat_ids(sb_model, question)
    config = GenerationConfig(**options)
    whole = await _run(backend, SequenceRequest("whole", prompt, config))
    tokens = [t for d in whole for t in d.token_ids]
    text = "".join(d.text for d in whole)
    assert len(whole) >= 4
    if config.min_new_tokens:  # it bit: the answer ends with EOS past min_new_tokens
        assert whole[-1].finish_reason == "stop" and len(tokens) > config.min_new_tokens
    points = _switch_points(whole)
    requests = [_resumed(f"resumed-{j}", prompt, config, whole[:j]) for j in points]
    answers = await asyncio.gather(*(_run(backend, r) for r in requests))
    assert packages(backend)[1:] == [{r.request_id for r in requests}]
    for j, request, rest in zip(points, requests, answers, strict=True):
        assert request.resumed_token_ids + [t for d in rest for t in d.token_ids] == tokens, j
        assert sum(d.num_new_tokens for d in rest) == len(tokens) - len(request.resumed_token_ids)
        head = text[: request.num_resumed_text_chars]
        assert head + "".join(d.text for d in rest) == text, j
        assert rest[-1].finish_reason == whole[-1].finish_reason, j


async def test_a_stop_string_that_straddles_the_switch_still_stops(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    """A stop string in the middle of the answer: resumed after every delta before it, the
    held-back start of the stop string comes from the resumed run, which cuts it there."""
    backend = await make_backend(interval=0.3)
    prompt = chat_ids(sb_model, "Write a short poem about the sea.")
    free = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    text = "".join(d.text for d in await _run(backend, SequenceRequest("free", prompt, free)))
    stop = text[8:14]
    config = free.model_copy(update={"stop": [stop]})
    whole = await _run(backend, SequenceRequest("stopped", prompt, config))
    expected = "".join(d.text for d in whole)
    assert expected == text[: text.index(stop)] and whole[-1].finish_reason == "stop"
    requests = [_resumed(f"resumed-{j}", prompt, config, whole[:j]) for j in range(1, len(whole))]
    assert requests, "the stop string ends the answer after its first delta"
    answers = await asyncio.gather(*(_run(backend, r) for r in requests))
    for request, rest in zip(requests, answers, strict=True):
        head = expected[: request.num_resumed_text_chars]
        assert head + "".join(d.text for d in rest) == expected, request.request_id
        assert rest[-1].finish_reason == "stop", request.request_id


async def test_a_resumed_choice_with_no_token_left_is_refused(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    backend = await make_backend()
    prompt = chat_ids(sb_model, "Hi")
    request = SequenceRequest(
        "spent", prompt, GenerationConfig(max_new_tokens=3), resumed_token_ids=[216, 33, 216]
    )
    with pytest.raises(APIError) as refused:
        await _run(backend, request)
    assert refused.value.status_code == 400
    assert refused.value.message == "the resumed choice has no token left to generate"
    assert packages(backend) == []


def _stream(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict], list[dict]]:
    """POST a streamed completion asking for the token comments: the ``: stream`` opening,
    each ``: tokens`` comment and each data event (usage included)."""
    opening: dict[str, Any] = {}
    comments: list[dict] = []
    events: list[dict] = []
    headers = {STREAM_TOKENS_HEADER: "1"}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith(": stream "):
                assert not opening and not comments and not events, "the opening comes first"
                opening = orjson.loads(line.removeprefix(": stream "))
            elif line.startswith(": tokens "):
                comments.append(orjson.loads(line.removeprefix(": tokens ")))
            elif line.startswith("data: ") and line != "data: [DONE]":
                events.append(orjson.loads(line.removeprefix("data: ")))
    return opening, comments, events


def _text(events: list[dict]) -> str:
    return "".join(c["text"] for e in events for c in e["choices"])


def test_http_completion_stream_resumed_from_its_comments(sb_server: ServerThread) -> None:
    """The gateway's view: an undisturbed stream's comments give the ids and characters so
    far; the same request with ``resume`` after the third comment streams the rest of the
    text under the same id and created, its usage counting the earlier tokens."""
    url = f"{sb_server.url}/v1/completions"
    body: dict[str, Any] = {
        "model": MODEL_ID,
        "prompt": "The sea is",
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    opening, comments, events = _stream(url, body)
    assert set(opening) == {"id", "created", "prompt_token_ids"} and opening["prompt_token_ids"]
    assert all(set(c) == {"0"} for c in comments) and len(comments) >= 4
    assert sum(len(c["0"][0]) for c in comments) == 10
    text = _text(events)
    assert sum(c["0"][1] for c in comments) == len(text)
    assert events[-1]["usage"]["completion_tokens"] == 10
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finish == ["length"]

    before = comments[:3]
    ids = [t for c in before for t in c["0"][0]]
    num_chars = sum(c["0"][1] for c in before)
    resume = {
        "response_id": opening["id"],
        "created": opening["created"],
        "prompt_token_ids": opening["prompt_token_ids"],
        "choices": [{"index": 0, "token_ids": ids, "num_text_chars": num_chars}],
        "num_completion_tokens": len(ids),
    }
    again, rest_comments, rest_events = _stream(url, {**body, "resume": resume})
    assert again == opening  # one answer: same id, created and prompt
    assert {e["id"] for e in rest_events} == {opening["id"]}
    assert {e["created"] for e in rest_events} == {opening["created"]}
    assert ids + [t for c in rest_comments for t in c["0"][0]] == [
        t for c in comments for t in c["0"][0]
    ]
    assert text[:num_chars] + _text(rest_events) == text
    assert rest_events[-1]["usage"]["completion_tokens"] == 10
    rest_finish = [c["finish_reason"] for e in rest_events for c in e["choices"]]
    assert [r for r in rest_finish if r] == ["length"]

    spent = {**resume, "choices": [{"index": 0, "token_ids": ids * 4, "num_text_chars": 0}]}
    refused = httpx.post(url, json={**body, "stream": False, "resume": spent}, timeout=60)
    assert refused.status_code == 400, refused.text
    assert "no token left" in refused.json()["error"]["message"]
