"""A CB server finishing a stream from the gateway's ``resume`` body (``protocol.resume``),
with the gateway's own tracker reading the first server's bytes: for chat (n=2, seeded
sampling), completions and native streams, the first events of an undisturbed stream plus the
resumed stream give the undisturbed text of every choice, under the same id, without a second
role opening, with usage counted once; the comment lines come only when asked."""

from __future__ import annotations

import json
from typing import Any

import pytest

from client.forwarding.stream_tokens import StreamTokens, num_choices_of
from harness.servers import ServerThread
from protocol.resume import STREAM_TOKENS_HEADER
from tests.support.default_model import MODEL_ID

HEADERS = {STREAM_TOKENS_HEADER: "1"}
ASK = [{"role": "user", "content": "Tell me a short story about a cat."}]


def _events(server: ServerThread, path: str, body: bytes) -> list[bytes]:
    """The raw bytes of a stream, one event at a time (comment lines included)."""
    raw = b""
    with server.http.stream("POST", path, content=body, headers=HEADERS, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        for piece in answer.iter_raw():
            raw += piece
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


def _texts(events: list[bytes], key: str) -> tuple[dict[int, str], list[dict[str, Any]]]:
    """Per choice, the text the events carry; and the parsed chunks."""
    texts: dict[int, str] = {}
    chunks = []
    for event in events:
        for line in event.split(b"\n"):
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                chunks.append(chunk)
                for choice in chunk["choices"]:
                    text = choice[key]["content"] if key == "delta" else choice[key]
                    texts[choice["index"]] = texts.get(choice["index"], "") + (text or "")
    return texts, chunks


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        (
            "/v1/chat/completions",
            {"messages": ASK, "n": 2, "temperature": 0.9, "seed": 4, "max_tokens": 24},
            "delta",
        ),
        (
            "/v1/completions",
            {"prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True, "temperature": 0},
            "text",
        ),
        (
            "/generate",
            {"prompt": "Rain is", "generation_config": {"max_new_tokens": 20, "ignore_eos": True}},
            "text",
        ),
    ],
    ids=["chat-n2-seeded", "completions-greedy", "native-greedy"],
)
@pytest.mark.parametrize("num_kept", [1, 6])
def test_a_resumed_stream_finishes_the_undisturbed_one(
    cb_server: ServerThread, path: str, body: dict[str, Any], key: str, num_kept: int
) -> None:
    raw_body = json.dumps({"model": MODEL_ID, "stream": True, **body}).encode()
    if path != "/generate":
        raw_body = json.dumps(
            {**json.loads(raw_body), "stream_options": {"include_usage": True}}
        ).encode()
    whole = _events(cb_server, path, raw_body)
    assert whole[0].startswith(b": stream ")
    expected, whole_chunks = _texts(whole, key)
    # The gateway saw the opening and num_kept token events, then the server died.
    tracker = StreamTokens()
    relayed = b"".join(tracker.feed(event) for event in whole[: 1 + num_kept])
    assert b": tokens" not in relayed and tracker.is_resumable
    resume_body = tracker.resume_body(raw_body, num_choices_of(raw_body))
    rest = _events(cb_server, path, resume_body)
    got_before, _ = _texts([relayed], key)
    got_after, rest_chunks = _texts(rest, key)
    for index, text in expected.items():
        assert got_before.get(index, "") + got_after.get(index, "") == text, index
    assert {c["id"] for c in rest_chunks} == {whole_chunks[0]["id"]}
    if key == "delta":  # the choices were open already: no second role
        assert all(c["delta"].get("role") is None for ch in rest_chunks for c in ch["choices"])
    usage = [c["usage"] for c in rest_chunks if c.get("usage")]
    expected_usage = [c["usage"] for c in whole_chunks if c.get("usage")]
    assert usage == expected_usage


def test_no_comment_lines_unless_asked(cb_server: ServerThread) -> None:
    body = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with cb_server.http.stream("POST", "/v1/completions", json=body, timeout=60) as answer:
        raw = b"".join(answer.iter_raw())
    assert b": stream" not in raw and b": tokens" not in raw and b"data: [DONE]" in raw


@pytest.mark.parametrize("direction", ["sb-to-cb", "cb-to-sb"])
def test_a_stream_moves_between_the_static_and_the_continuous_batching_server(
    cb_server: ServerThread, sb_server: ServerThread, direction: str
) -> None:
    """The SB server answers a batch all at once or not at all, yet what it streamed is
    enough for a CB server to finish its answer, greedy token for token (both equal
    transformers in float32), and the other way round."""
    first, second = (sb_server, cb_server) if direction == "sb-to-cb" else (cb_server, sb_server)
    body = {
        "model": MODEL_ID,
        "prompt": "The three laws of thermodynamics are",
        "max_tokens": 16,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    raw_body = json.dumps(body).encode()
    whole = _events(first, "/v1/completions", raw_body)
    expected, _ = _texts(whole, "text")
    tracker = StreamTokens()
    relayed = b"".join(tracker.feed(event) for event in whole[:5])
    rest = _events(second, "/v1/completions", tracker.resume_body(raw_body, 1))
    assert _texts([relayed], "text")[0][0] + _texts(rest, "text")[0][0] == expected[0]
