"""The ``<think>`` split (``server.common.reasoning``): whole answers, and streams cut
anywhere adding up to the whole split; whether the prompt leaves a thought open."""

from __future__ import annotations

import random

import pytest

from server.common.reasoning import ReasoningStream, is_thinking_at_start, split_reasoning

CASES = [
    ("<think>a b</think>\n\nThe answer", False, ("a b", "The answer")),
    ("step one</think>\n\nParis.", True, ("step one", "Paris.")),
    ("Plain answer", False, (None, "Plain answer")),
    ("<think>never closed", False, ("never closed", None)),
    ("still thinking", True, ("still thinking", None)),
    ("  <think></think>\n\nHi", False, ("", "Hi")),
    ("<thinking is not a tag", False, (None, "<thinking is not a tag")),
    ("a </thin b", True, ("a </thin b", None)),
]


@pytest.mark.parametrize(("text", "is_thinking", "expected"), CASES)
def test_any_pieces_add_up_to_the_whole_split(
    text: str, is_thinking: bool, expected: tuple[str | None, str | None]
) -> None:
    assert split_reasoning(text, is_thinking=is_thinking) == expected
    draw = random.Random(text)
    for _ in range(200):
        cuts = sorted(draw.sample(range(1, len(text)), draw.randint(0, min(8, len(text) - 1))))
        edges = [0, *cuts, len(text)]
        stream = ReasoningStream(is_thinking=is_thinking)
        parts = [stream.feed(text[a:b]) for a, b in zip(edges, edges[1:], strict=False)]
        parts.append(stream.finish())
        reasoning = "".join(p.reasoning for p in parts)
        content = "".join(p.content for p in parts)
        split = (reasoning if stream.has_reasoning else None), (content or None)
        assert split == expected, cuts


def test_a_prompt_that_opens_a_thought() -> None:
    assert is_thinking_at_start("<|im_start|>assistant\n<think>\n")
    assert not is_thinking_at_start("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not is_thinking_at_start("<think>old</think> turn <|im_start|>assistant\n")
    assert not is_thinking_at_start("<|im_start|>assistant\n")
