"""How a model writes tool calls, one class per syntax: what is read out of its text, what a
forced call (``tool_choice`` required or named) is constrained to, and how a stream reads it.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes,
  Qwen2.5/Qwen3, and our fallback prompt for templates that know no tools); streamed as the
  arguments are generated (:class:`~server.common.tool_call_stream.ToolCallStream`).
- ``llama3_json``: Llama 3.x's answer that is nothing but calls, ``{"name": ...,
  "parameters": {...}}`` objects (``;`` apart, after an optional ``<|python_tag|>``).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects; the
  text before it is content. Its marker is a special token, so such answers keep them.

The last two are streamed as content until their calls begin; the calls come whole at the end.
``serving_config.tool_call_parser`` names one, or ``auto`` reads the chat template.
"""

from __future__ import annotations

import abc
import json
from typing import Any, ClassVar, Literal

from server.common.tool_call_stream import (
    CallDelta,
    CallStreamReader,
    StreamedPart,
    ToolCallStream,
)
from server.common.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    call_from_object,
    call_schema,
    parse_tool_calls,
)
from utils.text import num_held_back

#: ``serving_config.tool_call_parser``.
ToolCallParserName = Literal["auto", "hermes", "llama3_json", "mistral"]

PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
#: llguidance's option for JSON written without optional whitespace (as structured output's).
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


class ToolSyntax(abc.ABC):
    """One way of writing calls."""

    name: ClassVar[str]
    #: True when the calls' marker is a special token the answer's text must keep.
    is_special_kept: ClassVar[bool] = False

    @abc.abstractmethod
    def parse(self, text: str, *, is_parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
        """The text's content and calls (the first call alone without ``is_parallel``)."""

    @abc.abstractmethod
    def grammar(self, tools: list[dict[str, Any]], name: str | None, *, is_parallel: bool) -> str:
        """The Lark grammar a forced answer follows: calls to ``name`` (None: any tool)."""

    def stream(self, *, is_parallel: bool = True) -> CallStreamReader:
        """A reader of one streamed answer."""
        return HeldCallStream(self, is_parallel=is_parallel)

    def calls_start(self, text: str) -> int | None:
        """Where calls begin in the text so far; None while it is content (for now)."""
        raise NotImplementedError

    def num_held(self, text: str) -> int:
        """How many characters at the end of ``text`` may still start the calls."""
        return 0


class HermesSyntax(ToolSyntax):
    """``<tool_call>`` blocks, streamed as they are generated."""

    name = "hermes"

    def parse(self, text: str, *, is_parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
        return parse_tool_calls(text, is_parallel=is_parallel)

    def grammar(self, tools: list[dict[str, Any]], name: str | None, *, is_parallel: bool) -> str:
        """``<tool_call>`` blocks of :func:`call_schema`'s JSON, a newline apart."""
        repeat = ' ("\\n" call)*' if is_parallel else ""
        return (
            f"start: call{repeat}\n"
            f"call: {json.dumps(TOOL_CALL_OPEN)} body {json.dumps(TOOL_CALL_CLOSE)}\n"
            f"body: %json {json.dumps({**call_schema(tools, name), **_COMPACT})}\n"
        )

    def stream(self, *, is_parallel: bool = True) -> CallStreamReader:
        return ToolCallStream(is_parallel=is_parallel)


def _decode_calls(text: str) -> list[ToolCall] | None:
    """The calls of ``text`` written as JSON objects (or lists of them) one after another,
    ``;`` or whitespace apart; None when it is anything else."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    position = 0
    while position < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        for item in value if isinstance(value, list) else [value]:
            call = call_from_object(item)
            if call is None:
                return None
            calls.append(call)
        while position < len(text) and (text[position].isspace() or text[position] == ";"):
            position += 1
    return calls or None


class Llama3JsonSyntax(ToolSyntax):
    """Llama 3.x: an answer of JSON call objects (``parameters``), nothing else."""

    name = "llama3_json"

    def parse(self, text: str, *, is_parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
        start = self.calls_start(text)
        calls = _decode_calls(_without_tag(text)) if start is not None else None
        if not calls:
            return text, []
        return None, calls if is_parallel else calls[:1]

    def grammar(self, tools: list[dict[str, Any]], name: str | None, *, is_parallel: bool) -> str:
        schema = {**call_schema(tools, name, arguments_key="parameters"), **_COMPACT}
        repeat = ' ("; " call)*' if is_parallel else ""
        return f"start: call{repeat}\ncall: %json {json.dumps(schema)}\n"

    def calls_start(self, text: str) -> int | None:
        body = text.lstrip()
        is_call = body.startswith(("{", PYTHON_TAG))
        return len(text) - len(body) if is_call else None

    def num_held(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if not body or PYTHON_TAG.startswith(body) else 0


def _without_tag(text: str) -> str:
    body = text.strip()
    return body[len(PYTHON_TAG) :].strip() if body.startswith(PYTHON_TAG) else body


class MistralSyntax(ToolSyntax):
    """Mistral: ``[TOOL_CALLS]`` and a JSON list of calls after the content."""

    name = "mistral"
    is_special_kept = True

    def parse(self, text: str, *, is_parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
        start = self.calls_start(text)
        if start is None:
            return text, []
        calls = _decode_calls(text[start + len(MISTRAL_CALLS) :].strip())
        if not calls:
            return text, []
        return text[:start].strip() or None, calls if is_parallel else calls[:1]

    def grammar(self, tools: list[dict[str, Any]], name: str | None, *, is_parallel: bool) -> str:
        schema = {**call_schema(tools, name), **_COMPACT}
        repeat = ' ("," call)*' if is_parallel else ""
        return (
            f'start: {json.dumps(MISTRAL_CALLS)} "[" call{repeat} "]"\n'
            f"call: %json {json.dumps(schema)}\n"
        )

    def calls_start(self, text: str) -> int | None:
        start = text.find(MISTRAL_CALLS)
        return start if start >= 0 else None

    def num_held(self, text: str) -> int:
        return num_held_back(text, [MISTRAL_CALLS])


class HeldCallStream:
    """A stream of a syntax read whole: content as it comes until the calls begin, then the
    rest held and read at the end (calls, or content again when it is none)."""

    def __init__(self, syntax: ToolSyntax, *, is_parallel: bool = True) -> None:
        self.syntax = syntax
        self.is_parallel = is_parallel
        self.num_calls = 0
        self._text = ""  # the answer so far
        self._num_shown = 0  # its characters streamed as content
        self._calls_start: int | None = None  # where the calls begin, once they do

    def feed(self, text: str) -> StreamedPart:
        """The content ``text`` adds (nothing once the calls began)."""
        part = StreamedPart()
        self._text += text
        if self._calls_start is not None:
            return part
        start = self.syntax.calls_start(self._text)
        if start is not None and start >= self._num_shown:
            self._calls_start = start
            end = start if self._text[self._num_shown : start].strip() else self._num_shown
        else:
            end = max(len(self._text) - self.syntax.num_held(self._text), self._num_shown)
        part.content = self._text[self._num_shown : end]
        self._num_shown = end
        return part

    def finish(self) -> StreamedPart:
        """The calls (whole), or what was held back, as content."""
        part = StreamedPart()
        calls: list[ToolCall] = []
        if self._calls_start is not None:
            held = self._text[self._calls_start :]
            _, calls = self.syntax.parse(held, is_parallel=self.is_parallel)
        if not calls:
            part.content = self._text[self._num_shown :]
            return part
        for index, call in enumerate(calls):
            part.calls.append(CallDelta(index, call.id, call.name, call.arguments))
        self.num_calls = len(calls)
        return part


SYNTAXES: dict[str, ToolSyntax] = {
    syntax.name: syntax for syntax in (HermesSyntax(), Llama3JsonSyntax(), MistralSyntax())
}


def syntax_for(parser: ToolCallParserName, chat_template: Any) -> ToolSyntax:
    """The syntax ``parser`` names; ``auto`` reads it from the chat template (Mistral's
    ``[TOOL_CALLS]``, Hermes/Qwen's ``<tool_call>``, Llama 3.x's ``<|python_tag|>`` or its
    ``"parameters"`` instruction), else Hermes (our fallback prompt's)."""
    if parser != "auto":
        return SYNTAXES[parser]
    template = chat_template if isinstance(chat_template, str) else ""
    if MISTRAL_CALLS in template:
        return SYNTAXES["mistral"]
    if TOOL_CALL_OPEN in template:
        return SYNTAXES["hermes"]
    if PYTHON_TAG in template or '"parameters": dictionary of argument name' in template:
        return SYNTAXES["llama3_json"]
    return SYNTAXES["hermes"]
