"""What a resumable stream has delivered so far: the gateway's side of ``protocol.resume``.

:class:`StreamTokens` sits in a stream from one of our servers (asked with
``STREAM_TOKENS_HEADER``). It cuts the bytes into whole events, strips the servers' comment
lines (callers never see them) and keeps, per choice, the token ids and the characters of
text of every event it passed on, and which choices finished. An event cut off by a dying
server is never passed on, nor counted: what the caller got and what is counted agree.
:meth:`StreamTokens.resume_body` is the request that asks another server for the rest.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from client.backends.translation import StreamTranslator
from protocol.resume import STREAM_COMMENT, TOKENS_COMMENT, ResumedChoice, StreamResume

_EVENT_END = b"\n\n"
#: The closing event, as a line of its own (a chunk's text may hold the same words).
_DONE = re.compile(rb"(?:^|\n)data: \[DONE\](?:\n|$)")
#: A choice that ended: every chunk shape (native, completions, chat) names its reason.
_FINISHED = re.compile(rb'"finish_reason":\s*"')


@dataclass
class ChoiceProgress:
    """One choice's streamed tokens and text."""

    token_ids: list[int] = field(default_factory=list)
    num_text_chars: int = 0
    is_finished: bool = False


class StreamTokens(StreamTranslator):
    """Tracks a resumable stream's tokens and strips the comment lines that carry them."""

    def __init__(self) -> None:
        self._buffer = b""
        self.choices: dict[int, ChoiceProgress] = {}
        #: From the server's ``: stream`` line: the answer's id, created, prompt ids.
        self.response_id: str | None = None
        self.created: int | None = None
        self.prompt_token_ids: list[int] = []
        self.is_done = False
        #: Events passed on to the caller (a resume is only worth it after the first).
        self.num_events = 0

    @property
    def is_resumable(self) -> bool:
        """True when the server said its stream can be resumed, and it has not ended."""
        return bool(self.prompt_token_ids) and self.response_id is not None and not self.is_done

    @property
    def num_tokens(self) -> int:
        """Tokens streamed so far, over every choice."""
        return sum(len(c.token_ids) for c in self.choices.values())

    def feed(self, data: bytes) -> bytes:
        """The whole events in ``data`` (and what came before it), without our comments."""
        self._buffer += data
        if _EVENT_END not in self._buffer:
            return b""
        complete, _, self._buffer = self._buffer.rpartition(_EVENT_END)
        if not complete.startswith(b":") and b"\n:" not in complete:
            # No comment line (a stream that cannot be resumed): the events go as they are.
            self._scan(complete)
            self.num_events += complete.count(_EVENT_END) + 1
            return complete + _EVENT_END
        out = [self._event(event) for event in complete.split(_EVENT_END)]
        return b"".join(out)

    def _scan(self, events: bytes) -> None:
        """Note the end of the stream and the choices that end, in events passed on (plain
        substring counts first: most events end nothing, and this runs on every one)."""
        if b"[DONE]" in events and _DONE.search(events):
            self.is_done = True
        num_reasons = events.count(b'"finish_reason"')
        if num_reasons and num_reasons != events.count(b'"finish_reason":null'):
            self._finish(events)

    def close(self) -> bytes:
        """An event cut off at the end is dropped (its server died writing it)."""
        self._buffer = b""
        return b""

    def switch(self) -> None:
        """Another server takes over: forget the broken server's partial event."""
        self._buffer = b""

    def _event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        kept = []
        for line in lines:
            if line.startswith(TOKENS_COMMENT):
                self._count(orjson.loads(line[len(TOKENS_COMMENT) :]))
            elif line.startswith(STREAM_COMMENT):
                self._open(orjson.loads(line[len(STREAM_COMMENT) :]))
            elif line:
                kept.append(line)
        if not kept:
            return b""
        out = b"\n".join(kept)
        self._scan(out)
        self.num_events += 1
        return out + _EVENT_END

    def _open(self, opening: dict[str, Any]) -> None:
        if self.response_id is None:  # a resumed server says the same again
            self.response_id = opening.get("id")
            self.created = opening.get("created")
            self.prompt_token_ids = list(opening.get("prompt_token_ids") or [])

    def _count(self, tokens: dict[str, list[Any]]) -> None:
        for index, (ids, num_chars) in tokens.items():
            progress = self.choices.setdefault(int(index), ChoiceProgress())
            progress.token_ids.extend(ids)
            progress.num_text_chars += num_chars

    def _finish(self, events: bytes) -> None:
        """Mark the choices that these events end (only the lines that end one are parsed)."""
        for line in events.split(b"\n"):
            if not line.startswith(b"data:") or not _FINISHED.search(line):
                continue
            try:
                chunk = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            for choice in chunk.get("choices") or []:
                if choice.get("finish_reason") is not None:
                    progress = self.choices.setdefault(int(choice["index"]), ChoiceProgress())
                    progress.is_finished = True

    def resume_body(self, body: bytes, num_choices: int) -> bytes:
        """``body`` (the caller's request) with the ``resume`` field that asks for the rest of
        the ``num_choices`` choices that have not finished."""
        assert self.response_id is not None
        unfinished = [
            ResumedChoice(
                index=i,
                token_ids=progress.token_ids,
                num_text_chars=progress.num_text_chars,
            )
            for i in range(num_choices)
            if not (progress := self.choices.get(i, ChoiceProgress())).is_finished
        ]
        resume = StreamResume(
            response_id=self.response_id,
            created=self.created,
            prompt_token_ids=self.prompt_token_ids,
            choices=unfinished,
            num_completion_tokens=self.num_tokens,
        )
        data = json.loads(body)
        data["resume"] = resume.model_dump(exclude_none=True)
        return json.dumps(data).encode()


def num_choices_of(body: bytes) -> int:
    """How many choices a request asks for (``n``, or ``num_return_sequences`` natively)."""
    data = json.loads(body)
    config = data.get("generation_config") or {}
    return int(data.get("n") or config.get("num_return_sequences") or 1)
