"""Config keys overridden from the environment: ``PREFIX__SECTION__KEY=value``.

Each app has its prefix (``LLM_SUITE_GATEWAY``, ``LLM_SUITE_CB_SERVER``, ``LLM_SUITE_SB_SERVER``,
``LLM_SUITE_DEPLOYMENT``); ``__`` separates the levels of the JSON file, names are
case-insensitive (the file's keys are lower case). In a list, a number picks an element (the
list's length appends one) and a word picks the element whose ``name`` it is::

    LLM_SUITE_CB_SERVER__CACHE_CONFIG__MEMORY_BUDGET_GB=2
    LLM_SUITE_GATEWAY__OPENAI_JUMPER_CONFIGS__0__API_KEY=sk-...
    LLM_SUITE_GATEWAY__API_KEYS='["key-1", "key-2"]'
    LLM_SUITE_DEPLOYMENT__APPS__CB_SERVER__PORT=9001

A value that starts with ``[`` or ``{``, or is ``null``, is JSON (an object replaces the whole
section, as a list replaces the whole list); anything else is a string that pydantic converts
as it converts the file's values (``"2"`` -> 2, ``"true"`` -> True). The overrides are applied
to the file's data before validation, so they are checked like the file, and an error at an
overridden key names the variable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

#: Between the prefix and each level of the key path.
SEPARATOR = "__"


class EnvOverrideError(ValueError):
    """An override that cannot be applied; the message names the variable (never its value)."""


def _parse(value: str) -> Any:
    stripped = value.strip()
    if stripped == "null" or stripped[:1] in ("[", "{"):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            return value  # validation then says what the key expected
    return value


def _child(node: Any, segment: str, variable: str) -> tuple[Any, Any]:
    """The container key/index that ``segment`` names in ``node`` (creating nothing)."""
    if isinstance(node, dict):
        return node, segment.lower()
    if isinstance(node, list):
        if segment.isdigit():
            index = int(segment)
            if index > len(node):
                raise EnvOverrideError(f"{variable}: index {index} is past the list's end")
            if index == len(node):
                node.append({})
            return node, index
        for index, item in enumerate(node):
            if isinstance(item, dict) and str(item.get("name", "")).lower() == segment.lower():
                return node, index
        raise EnvOverrideError(f"{variable}: no element named {segment.lower()!r} in the list")
    raise EnvOverrideError(f"{variable}: {segment.lower()!r} is below a value that is no object")


def apply_env_overrides(
    data: dict[str, Any], prefix: str, environ: Mapping[str, str] | None = None
) -> dict[tuple[str | int, ...], str]:
    """Apply every ``PREFIX__...`` variable to ``data`` in place.

    Returns ``{key path: variable}`` of what was set, so that a validation error at such a key
    can name the variable. Shorter paths apply first: a whole section, then keys inside it.
    """
    environ = os.environ if environ is None else environ
    start = prefix + SEPARATOR
    applied: dict[tuple[str | int, ...], str] = {}
    variables = sorted((name for name in environ if name.upper().startswith(start.upper())),
                       key=lambda name: (name.count(SEPARATOR), name))  # fmt: skip
    for variable in variables:
        segments = [s for s in variable[len(start) :].split(SEPARATOR)]
        if not all(segments):
            raise EnvOverrideError(f"{variable}: an empty level in the key path")
        node: Any = data
        path: list[str | int] = []
        for segment in segments[:-1]:
            container, key = _child(node, segment, variable)
            if isinstance(container, dict) and not isinstance(container.get(key), dict | list):
                container[key] = {}
            node = container[key]
            path.append(key)
        container, key = _child(node, segments[-1], variable)
        container[key] = _parse(environ[variable])
        applied[(*path, key)] = variable
    return applied


def variable_for(loc: tuple[str | int, ...], applied: dict[tuple[str | int, ...], str]) -> str:
    """The variable that set ``loc`` or a key above it, else ``""``."""
    for length in range(len(loc), 0, -1):
        if loc[:length] in applied:
            return applied[loc[:length]]
    return ""
