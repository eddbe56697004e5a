"""Tool calls read out of a chat stream as its text comes: content as it comes, each
``<tool_call>`` block as a call opened (id and name) then its arguments' JSON in fragments, as
OpenAI streams them and the ``openai`` SDK reassembles them.

A block written ``{"name": ..., "arguments": {...}}`` (the order the fallback prompt and the
forced-call grammar ask for) streams its arguments character by character as they are
generated: a small JSON scanner finds where the arguments object ends. A block in any other
shape is read whole once it closes (as :func:`~server.common.tool_calls.parse_tool_calls`
reads it) and sent in one piece; one that is no call stays text. Text that may still become
``<tool_call>`` is held back until it is told apart, and so is whitespace that may end up
before a call or at the end of an answer with calls (whose content is stripped). Plain Python,
no I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal, Protocol

from server.common.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, call_of_text
from utils.text import num_held_back

#: The start of a block whose name comes first: ``{"name": "<json string>", "arguments":``.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')

_State = Literal["text", "head", "arguments", "scalar", "tail", "skip"]


@dataclass
class CallDelta:
    """News of one call: ``id`` and ``name`` when it opens, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamedPart:
    """What a piece of text adds to the answer: content, and news of calls."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def call(self, index: int) -> CallDelta:
        """The news of call ``index`` in this part (added if it has none yet)."""
        if not self.calls or self.calls[-1].index != index:
            self.calls.append(CallDelta(index))
        return self.calls[-1]


class CallStreamReader(Protocol):
    """What reads one streamed answer into content and call deltas, whatever the syntax:
    :class:`ToolCallStream` (Hermes blocks, streamed as they come) or ``tool_syntax``'s
    ``HeldCallStream`` (calls whole at the end)."""

    #: The calls read so far (an answer that called ends with ``finish_reason: tool_calls``).
    num_calls: int

    def feed(self, text: str) -> StreamedPart:
        """What the answer's next piece of text adds."""
        ...

    def finish(self) -> StreamedPart:
        """What is left when the answer ends."""
        ...


class ToolCallStream:
    """Turns one choice's text, piece by piece, into content and call deltas."""

    def __init__(self, *, is_parallel: bool = True) -> None:
        self.is_parallel = is_parallel
        #: Calls completed (their block closed, or their arguments ended).
        self.num_calls = 0
        self._state: _State = "text"
        self._pending = ""  # text not yet read
        self._block = ""  # the current block's text after <tool_call>
        self._space = ""  # whitespace held back between content pieces
        self._is_any_call = False  # a block has begun
        self._depth = 0
        self._is_in_string = False
        self._is_escaped = False

    def feed(self, text: str) -> StreamedPart:
        """The news ``text`` brings (it follows the text fed before)."""
        part = StreamedPart()
        self._pending += text
        while self._pending:
            before = (self._state, len(self._pending))
            getattr(self, f"_read_{self._state}")(part)
            if (self._state, len(self._pending)) == before:
                break  # waiting for more text
        return part

    def finish(self) -> StreamedPart:
        """The news once the text has ended: what was held back."""
        part = StreamedPart()
        if self._state == "text":
            self._add_content(part, self._pending)
            if not self._is_any_call:  # no call at all: the text is the answer, as it is
                part.content += self._space
        elif self._state == "head":  # an unfinished block that never became a call: text
            self._add_content(part, TOOL_CALL_OPEN + self._block + self._pending)
        self._pending = ""
        self._state = "text"
        return part

    def _add_content(self, part: StreamedPart, text: str) -> None:
        """Show ``text`` as content, less the whitespace it ends with (held until more content
        follows: before a call or at the end it is no content)."""
        if not text.strip():
            self._space += text
            return
        body = text.rstrip()
        part.content += self._space + body
        self._space = text[len(body) :]

    def _read_text(self, part: StreamedPart) -> None:
        start = self._pending.find(TOOL_CALL_OPEN)
        if start < 0:
            keep = num_held_back(self._pending, [TOOL_CALL_OPEN])
            self._add_content(part, self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            return
        self._add_content(part, self._pending[:start])
        self._pending = self._pending[start + len(TOOL_CALL_OPEN) :]
        self._block = ""
        self._is_any_call = True
        self._state = "head" if self.is_parallel or self.num_calls == 0 else "skip"

    def _read_head(self, part: StreamedPart) -> None:
        self._block += self._pending
        self._pending = ""
        match = _HEAD.match(self._block)
        if match is not None:
            call = part.call(self.num_calls)
            call.id = f"call_{uuid.uuid4().hex[:24]}"
            call.name = json.loads(match.group(1))
            self._pending, self._block = self._block[match.end() :], ""
            self._depth, self._is_in_string, self._is_escaped = 0, False, False
            self._state = "arguments"
            return
        end = self._block.find(TOOL_CALL_CLOSE)
        if end < 0:
            return  # not a name-first block (yet): read it whole once it closes
        whole = call_of_text(self._block[:end].strip())
        if whole is None:
            self._add_content(part, TOOL_CALL_OPEN + self._block[: end + len(TOOL_CALL_CLOSE)])
        else:
            call = part.call(self.num_calls)
            call.id, call.name, call.arguments = whole.id, whole.name, whole.arguments
            self.num_calls += 1
        self._pending = self._block[end + len(TOOL_CALL_CLOSE) :]
        self._state = "text"

    def _read_arguments(self, part: StreamedPart) -> None:
        taken = []
        for position, char in enumerate(self._pending):
            if self._depth == 0 and not taken:
                if char.isspace():
                    continue
                if char not in "{[":  # arguments that are no object: read to the block's end
                    self._pending = self._pending[position:]
                    self._block = ""
                    self._state = "scalar"
                    return
            taken.append(char)
            if self._is_in_string:
                if self._is_escaped:
                    self._is_escaped = False
                elif char == "\\":
                    self._is_escaped = True
                elif char == '"':
                    self._is_in_string = False
            elif char == '"':
                self._is_in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    part.call(self.num_calls).arguments += "".join(taken)
                    self._pending = self._pending[position + 1 :]
                    self.num_calls += 1
                    self._state = "tail"
                    return
        if taken:
            part.call(self.num_calls).arguments += "".join(taken)
        self._pending = ""

    def _read_tail(self, part: StreamedPart) -> None:
        self._read_to_close()

    def _read_scalar(self, part: StreamedPart) -> None:
        block = self._block + self._pending
        end = block.find(TOOL_CALL_CLOSE)
        if end < 0:
            self._block, self._pending = block, ""
            return
        value = block[:end].rstrip()
        value = value[:-1].rstrip() if value.endswith("}") else value  # the block's own brace
        part.call(self.num_calls).arguments += value
        self.num_calls += 1
        self._block, self._pending = "", block[end + len(TOOL_CALL_CLOSE) :]
        self._state = "text"

    def _read_skip(self, part: StreamedPart) -> None:
        self._read_to_close()

    def _read_to_close(self) -> None:
        """Drop text up to the block's close (the arguments' closing brace, a call dropped
        by ``parallel_tool_calls: false``)."""
        self._block += self._pending
        end = self._block.find(TOOL_CALL_CLOSE)
        if end < 0:
            self._pending = ""
            return
        self._pending = self._block[end + len(TOOL_CALL_CLOSE) :]
        self._block = ""
        self._state = "text"
