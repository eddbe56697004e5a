"""The parts of OpenAI request bodies: stream options, the response format, and tools (the
functions the model may call, and which one ``tool_choice`` forces)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StreamOptions(BaseModel):
    """``stream_options``: only ``include_usage`` has a meaning here."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the output must validate against."""

    model_config = ConfigDict(extra="allow")

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (default), ``json_object`` (any JSON object) or
    ``json_schema`` (JSON valid against ``json_schema.schema``), as OpenAI defines them."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("'json_schema' is required when 'type' is 'json_schema'")
        return self

    def schema_of_output(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow (None: free text)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema" and self.json_schema is not None:
            return self.json_schema.schema_
        return None


class FunctionDefinition(BaseModel):
    """A function the model may call: its name and its parameters' JSON schema."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    """The function a named ``tool_choice`` forces."""

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: ToolChoiceFunction
