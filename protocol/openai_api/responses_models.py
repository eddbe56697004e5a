"""Request body of OpenAI's Responses API (``POST /v1/responses``), as the ``openai`` SDK's
``client.responses.create`` sends it, and its translation into a chat completion request.

Served: ``input`` (a string, or items: messages with text parts, ``function_call`` and
``function_call_output`` items, reasoning items given back, which are skipped),
``instructions``, function ``tools`` with ``tool_choice`` and ``parallel_tool_calls``,
``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (``text``, ``json_object``,
``json_schema``), ``reasoning.effort``, ``stream``, ``store``, ``previous_response_id``,
``metadata``, ``user``. Other tool types (web search, files, computer use) are refused by
name; fields not declared at all go to the servers' unknown-field policy.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.openai_api.request_models import ChatCompletionRequest


class InputText(BaseModel):
    """A text part of a message's content (``input_text``, or ``output_text`` given back)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: str


class MessageItem(BaseModel):
    """A message of the conversation (``type`` may be left out, as the SDK's easy form)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made earlier, given back."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """A call's result."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(BaseModel):
    """A reasoning item given back: the model does not read its own earlier thoughts."""

    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(BaseModel):
    """A function tool (the Responses API's flat form of a chat tool)."""

    model_config = ConfigDict(extra="allow")

    type: str = "function"
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _only_functions(cls, data: Any) -> Any:
        kind = data.get("type", "function") if isinstance(data, dict) else "function"
        if kind != "function":
            raise ValueError(f"tools of type {kind!r} are not supported; only 'function'")
        return data


class NamedFunction(BaseModel):
    """``tool_choice: {"type": "function", "name": ...}``."""

    type: Literal["function"] = "function"
    name: str


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its schema."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    """``text``: the output's format."""

    model_config = ConfigDict(extra="allow")

    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningOptions(BaseModel):
    """``reasoning``: the effort (given to the chat template as ``reasoning_effort``)."""

    model_config = ConfigDict(extra="allow")

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesRequest(BaseModel):
    """Body of ``POST /v1/responses``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    truncation: Literal["disabled"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _typed_messages(cls, data: Any) -> Any:
        """Input items without ``type`` are messages (the SDK's easy input form)."""
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = dict(data)
            data["input"] = [
                {**item, "type": "message"} if isinstance(item, dict) and "type" not in item
                else item
                for item in data["input"]
            ]  # fmt: skip
        return data

    @property
    def unknown_fields(self) -> list[str]:
        """The body's fields this API does not declare, sorted."""
        return sorted(self.model_extra or {})

    def input_messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages: a string is one user message; calls given back join
        one assistant turn's ``tool_calls``; results are ``tool`` messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                )
        return messages

    def to_chat(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that asks the same, ``conversation`` (the earlier turns and this
        request's input) after the instructions."""
        messages = list(conversation)
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": tool.model_dump(exclude={"type"}, exclude_none=True),
                }
                for tool in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format.type != "text":
            fmt = self.text.format
            body["response_format"] = (
                {"type": "json_object"}
                if fmt.type == "json_object"
                else {
                    "type": "json_schema",
                    "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_ or {}},
                }
            )
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        return ChatCompletionRequest.model_validate(body)
