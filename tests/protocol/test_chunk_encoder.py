"""``utils.sse.ChunkEncoder``: events byte-for-byte what the pydantic chunk models would send."""

from __future__ import annotations

import json

import pytest

from protocol.generation import Choice, GenerateStreamChunk
from protocol.openai_api import (
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)
from utils.sse import ChunkEncoder, encode_event


def test_chat_chunks_match_the_model() -> None:
    envelope = ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[])
    choices = [
        ChatCompletionChunkChoice(index=0, delta=ChatDelta(role="assistant", content='é\n"')),
        ChatCompletionChunkChoice(index=1, delta=ChatDelta(), finish_reason="length"),
    ]
    expected = envelope.model_copy(update={"choices": choices})
    encoded = ChunkEncoder(envelope).encode([c.model_dump() for c in choices])
    assert encoded == encode_event(expected)


def test_completion_and_native_chunks_match_their_models() -> None:
    completion = CompletionResponse(id="cmpl-1", model="m", choices=[])
    choice = CompletionChoice(index=2, text=" Paris", finish_reason="stop")
    assert ChunkEncoder(completion).encode([choice.model_dump()]) == encode_event(
        completion.model_copy(update={"choices": [choice]})
    )
    native = GenerateStreamChunk(id="gen-1", model="m", choices=[])
    native_choice = Choice(index=0, text="x")
    event = ChunkEncoder(native).encode([native_choice.model_dump()])
    assert json.loads(event.removeprefix(b"data: ")) == json.loads(
        encode_event(native.model_copy(update={"choices": [native_choice]})).removeprefix(b"data: ")
    )


def test_an_envelope_with_choices_is_refused() -> None:
    envelope = GenerateStreamChunk(id="gen-1", model="m", choices=[Choice(index=0, text="x")])
    with pytest.raises(ValueError, match="empty 'choices'"):
        ChunkEncoder(envelope)


def test_dict_events_are_compact_utf8_json() -> None:
    assert (
        encode_event({"error": {"message": "é"}}) == 'data: {"error":{"message":"é"}}\n\n'.encode()
    )
