"""Reasoning split out of a chat answer: a ``<think>...</think>`` part (Qwen3, DeepSeek-R1,
QwQ and their kin) goes to the message's ``reasoning_content``, the rest to ``content``, whole
or streamed, as vLLM's reasoning parsers do.

Whether the answer starts inside a thought depends on the prompt: DeepSeek-R1's template
ends the prompt with ``<think>`` (the model writes only the thought's end), Qwen3's lets the
model open it, and Qwen3 with ``enable_thinking: false`` closes an empty one in the prompt.
So :func:`is_thinking_at_start` reads the rendered prompt: an unclosed ``<think>`` after the
last ``</think>`` means the output begins as reasoning. Otherwise an output that opens with
``<think>`` (after whitespace) reasons until ``</think>``; one that does not is all content.
A thought that never closes is all reasoning. Plain Python, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from utils.text import num_held_back

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

#: ``serving_config.reasoning_parser``: ``auto`` splits ``<think>`` parts when the model's chat
#: template writes them, ``think`` always, ``none`` never (the thought stays in the content).
ReasoningParserName = Literal["auto", "think", "none"]

_State = Literal["start", "reasoning", "gap", "content"]


def is_splitting(name: ReasoningParserName, tokenizer: Any) -> bool:
    """True when answers of ``tokenizer``'s model get their reasoning split out."""
    if name == "auto":
        template = getattr(tokenizer, "chat_template", None)
        return isinstance(template, str) and THINK_CLOSE in template
    return name == "think"


def is_thinking_at_start(prompt: str) -> bool:
    """True when ``prompt`` leaves a ``<think>`` open, so the output begins as reasoning."""
    opened = prompt.rfind(THINK_OPEN)
    return opened >= 0 and prompt.find(THINK_CLOSE, opened) < 0


@dataclass
class ReasoningPart:
    """What a piece of output adds: reasoning text and content text."""

    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """Splits one choice's output, piece by piece, into reasoning and content."""

    def __init__(self, *, is_thinking: bool) -> None:
        self._state: _State = "reasoning" if is_thinking else "start"
        self._pending = ""
        #: True once some reasoning was seen (an answer with a thought, even empty).
        self.has_reasoning = is_thinking

    def feed(self, text: str) -> ReasoningPart:
        """The reasoning and content ``text`` adds (it follows the text fed before)."""
        part = ReasoningPart()
        self._pending += text
        while self._pending:
            if self._state == "start":
                stripped = self._pending.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._pending = stripped[len(THINK_OPEN) :]
                    self._state, self.has_reasoning = "reasoning", True
                elif not stripped or THINK_OPEN.startswith(stripped):
                    break  # may still open a thought
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                end = self._pending.find(THINK_CLOSE)
                if end < 0:
                    keep = len(self._pending) - num_held_back(self._pending, [THINK_CLOSE])
                    part.reasoning += self._pending[:keep]
                    self._pending = self._pending[keep:]
                    break
                part.reasoning += self._pending[:end]
                self._pending = self._pending[end + len(THINK_CLOSE) :]
                self._state = "gap"
            elif self._state == "gap":  # the blank lines models write after the thought
                self._pending = self._pending.lstrip("\n")
                if self._pending:
                    self._state = "content"
            else:
                part.content += self._pending
                self._pending = ""
        return part

    def finish(self) -> ReasoningPart:
        """What was held back, once the output has ended."""
        part = ReasoningPart()
        if self._state == "reasoning":
            part.reasoning = self._pending
        elif self._state in ("start", "content"):
            part.content = self._pending
        self._pending = ""
        return part


def split_reasoning(text: str, *, is_thinking: bool) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning, content); None for a part it does not have."""
    stream = ReasoningStream(is_thinking=is_thinking)
    first, last = stream.feed(text), stream.finish()
    reasoning, content = first.reasoning + last.reasoning, first.content + last.content
    return (reasoning if stream.has_reasoning else None), (content or None)
