"""vLLM's ``structured_outputs``: one constraint on the output's text (a JSON schema, any JSON
object, a regular expression, a choice among strings, a context-free grammar, or tool calls
tagged in running text), with vLLM's names and meanings.

This module only describes and checks the request; the servers compile the constraint with
llguidance (``server.common.structured_output``) and mask every step by it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

#: What a constraint is written in, as the grammar compiler takes it.
GrammarKind = Literal["json", "regex", "choice", "grammar", "structural_tag"]

#: The constraint fields of ``structured_outputs``: exactly one is given.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputs(BaseModel):
    """``structured_outputs`` (vLLM's ``StructuredOutputsParams``): exactly one of

    - ``json``: a JSON schema (an object, or its JSON text) the output validates against;
    - ``json_object``: true: any JSON object;
    - ``regex``: the output matches this regular expression (Rust ``regex`` syntax, anchored);
    - ``choice``: the output is one of these strings;
    - ``grammar``: a context-free grammar, in llama.cpp's GBNF or in Lark syntax;
    - ``structural_tag``: vLLM's JSON text ``{"type": "structural_tag", "structures": [{"begin",
      "schema", "end"}], "triggers": [...]}``: free text in which each tagged part (a tool call,
      say) that starts with a trigger follows its schema.

    ``disable_any_whitespace`` and ``disable_fallback`` are accepted and always hold here: JSON
    is written without optional whitespace, and there is one grammar library, so nothing to fall
    back to. ``disable_additional_properties`` and ``whitespace_pattern`` are refused.
    """

    model_config = ConfigDict(
        extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    # ``json`` would shadow pydantic's deprecated ``BaseModel.json``; the wire name is the alias.
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    json_object: bool | None = None
    structural_tag: str | None = Field(default=None, min_length=1)
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [
            name
            for name, value in zip(CONSTRAINT_FIELDS, self._constraint_values(), strict=True)
            if value not in (None, False)
        ]
        if len(given) != 1:
            listed = ", ".join(f"'{name}'" for name in given) or "none"
            raise ValueError(
                "exactly one of 'json', 'regex', 'choice', 'grammar', 'json_object' or "
                f"'structural_tag' must be given; got {listed}"
            )
        if self.disable_additional_properties:
            raise ValueError("'disable_additional_properties' is not supported")
        if self.whitespace_pattern is not None:
            raise ValueError("'whitespace_pattern' is not supported (JSON has no optional space)")
        if isinstance(self.json_schema, str):
            try:
                schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise ValueError(f"'json' is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("'json' must be a JSON schema (an object)")
        if self.structural_tag is not None:
            structural_tags(self.structural_tag)  # raises on a malformed tag
        return self

    def _constraint_values(self) -> tuple[Any, ...]:
        return (
            self.json_schema,
            self.regex,
            self.choice,
            self.grammar,
            self.json_object,
            self.structural_tag,
        )

    def grammar_source(self) -> tuple[GrammarKind, str]:
        """The constraint as (kind, text) for the grammar compiler."""
        if self.json_object:
            return "json", json.dumps({"type": "object"})
        if self.json_schema is not None:
            text = self.json_schema
            return "json", text if isinstance(text, str) else json.dumps(text)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        assert self.structural_tag is not None  # exactly one is set (checked)
        return "structural_tag", self.structural_tag


class TagStructure(BaseModel):
    """One tagged structure of a structural tag: ``begin`` (it starts with a trigger), the
    JSON ``schema`` of what follows, then ``end``."""

    model_config = ConfigDict(extra="forbid")

    begin: str = Field(min_length=1)
    schema_: dict[str, Any] = Field(alias="schema")
    end: str = ""


class StructuralTag(BaseModel):
    """vLLM's ``structural_tag`` (its ``structures`` and ``triggers`` form)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["structural_tag"] = "structural_tag"
    structures: list[TagStructure] = Field(min_length=1)
    triggers: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _each_begins_with_a_trigger(self) -> StructuralTag:
        for structure in self.structures:
            if self.trigger_of(structure) is None:
                raise ValueError(
                    f"structure begin {structure.begin!r} starts with none of the triggers"
                )
        return self

    def trigger_of(self, structure: TagStructure) -> str | None:
        """The longest trigger ``structure.begin`` starts with."""
        matching = [t for t in self.triggers if t and structure.begin.startswith(t)]
        return max(matching, key=len) if matching else None


def structural_tags(text: str) -> StructuralTag:
    """The parsed ``structural_tag`` text; ``ValueError`` says what is wrong with it."""
    try:
        return StructuralTag.model_validate_json(text)
    except ValueError as exc:
        raise ValueError(f"'structural_tag' is not a valid structural tag: {exc}") from None


def one_constraint(
    given: StructuredOutputs | None, older: dict[str, Any], has_response_format: bool
) -> StructuredOutputs | None:
    """A request's one output constraint: ``structured_outputs``, or the older field of
    ``older`` (``{"guided_regex": ..., "structural_tag": ...}``, None where unset) turned into
    it. ``ValueError`` when more than one is given (``response_format`` with a schema counts)
    or the older field's value is invalid, naming the fields."""
    set_older = {name: value for name, value in older.items() if value is not None}
    names = [*(["response_format"] if has_response_format else [])]
    names += [*(["structured_outputs"] if given is not None else []), *set_older]
    if len(names) > 1:
        listed = ", ".join(f"'{name}'" for name in names)
        raise ValueError(f"only one constraint on the output may be given; got {listed}")
    if not set_older:
        return given
    ((field, value),) = set_older.items()
    try:
        return StructuredOutputs.model_validate({field.removeprefix("guided_"): value})
    except ValidationError as exc:
        reason = "; ".join(error["msg"] for error in exc.errors())
        raise ValueError(f"'{field}': {reason}") from None
