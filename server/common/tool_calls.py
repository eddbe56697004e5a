"""Tool calls (OpenAI's ``tools`` and ``tool_choice``) on models whose chat template may or may
not know tools.

A template that knows tools (Qwen2.5, Llama 3.1, Hermes, Mistral ...) renders them itself: the
``tools`` list goes to ``apply_chat_template``. A template that knows none (it renders the
same text with and without them, as SmolLM2's does) gets the documented fallback: a system
message listing the functions' JSON schemas and asking for calls written as

    <tool_call>{"name": "<function>", "arguments": {...}}</tool_call>

the format Hermes and Qwen use; earlier calls and tool results in the conversation are written
back the same way (``<tool_response>`` for results), so the model sees one convention.

``tool_choice``: ``none`` renders no tools; ``auto`` lets the model answer or call; ``required``
and a named function constrain the output with ``HermesSyntax.grammar``
(``tool_syntax.py``): one or more
``<tool_call>`` blocks (one with ``parallel_tool_calls: false``) whose JSON follows
:func:`call_schema`, through structured output, so they always parse. :func:`parse_tool_calls`
reads calls out of the text either way (the first only, with ``parallel_tool_calls: false``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.S
)


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made: its name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = ""

    def with_id(self) -> ToolCall:
        """The call with an id of its own (``call_...``, as OpenAI names them)."""
        return ToolCall(self.name, self.arguments, self.id or f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        """The call in an OpenAI message's ``tool_calls``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The ``function`` object of an OpenAI tool."""
    return tool.get("function") or {}


def fallback_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The system text that teaches a template without tools to call them."""
    listed = "\n".join(json.dumps(function_of(tool)) for tool in tools)
    return (
        "You can call functions. These are the functions you may call, as JSON schemas:\n"
        f"{listed}\n"
        "To call a function, answer with\n"
        f'{TOOL_CALL_OPEN}{{"name": "<function name>", "arguments": {{<its arguments>}}}}'
        f"{TOOL_CALL_CLOSE}\n"
        "and nothing else; answer in text when no function helps."
    )


def fallback_conversation(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """``conversation`` (role/content dicts, plus ``tool_calls`` on assistant turns and
    ``tool_call_id`` on tool results) for a template that knows no tools: the tools in the
    system message, calls and results written as text."""
    out: list[dict[str, Any]] = []
    for message in conversation:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                TOOL_CALL_OPEN
                + json.dumps(
                    {
                        "name": function_of(call).get("name"),
                        "arguments": _arguments_object(function_of(call).get("arguments")),
                    }
                )
                + TOOL_CALL_CLOSE
                for call in message["tool_calls"]
            ]
            out.append({"role": "assistant", "content": (content + "".join(calls)).strip()})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>{content}</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        prompt = fallback_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments_object(arguments: object) -> object:
    """Arguments as the object they encode (OpenAI sends them as a JSON string)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}


def call_schema(
    tools: list[dict[str, Any]], name: str | None = None, *, arguments_key: str = "arguments"
) -> dict[str, Any]:
    """The JSON schema of one call to ``name`` (None: to any of ``tools``): what
    ``tool_choice: required`` or a named function constrains the output to (the arguments
    under ``arguments_key``: Llama 3 writes ``parameters``)."""
    options = []
    for tool in tools:
        function = function_of(tool)
        if name is not None and function.get("name") != name:
            continue
        parameters = function.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function.get("name")}, arguments_key: parameters},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    if not options:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    return options[0] if len(options) == 1 else {"anyOf": options}


def parse_tool_calls(text: str, *, is_parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """The text's content and calls: its ``<tool_call>`` blocks (only the first without
    ``is_parallel``: OpenAI's ``parallel_tool_calls: false`` answers one call at most, later
    ones are dropped). Blocks that are not a JSON call stay text."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        call = call_of_text(match.group(1))
        if call is None:
            continue
        kept.append(text[last : match.start()])
        if is_parallel or not calls:
            calls.append(call)
        last = match.end()
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def call_of_text(text: str) -> ToolCall | None:
    """The call a block's JSON makes; None if none."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return call_from_object(data)


def call_from_object(data: Any) -> ToolCall | None:
    """The call a JSON object makes (``name`` and ``arguments``, or Llama's ``parameters``),
    with an id of its own; None when it is no call."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return ToolCall(data["name"], json.dumps(arguments)).with_id()
