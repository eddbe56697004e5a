"""Loading JSON configs into pydantic models with errors that name file, key and problem.

A schema with a ``env_prefix`` class variable takes overrides from the environment
(``utils.env_overrides``); an error at an overridden key names the variable too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from utils.env_overrides import EnvOverrideError, apply_env_overrides, variable_for

ConfigT = TypeVar("ConfigT", bound=BaseModel)
#: Which keys the environment set: key path -> variable (``utils.env_overrides``).
Overrides = dict[tuple[str | int, ...], str]


class ConfigSection(BaseModel):
    """Base of every section of the servers' config files.

    Unknown keys are refused, so a misspelt key stops start-up with a message naming it
    (``load_config`` words it "unknown key") instead of being silently ignored. The
    ``model_`` namespace is open because keys such as ``model_name_or_path`` and
    ``model_loading_config`` come from the seed's config files.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


@dataclass(frozen=True)
class ConfigProblem:
    """One key of a config file that failed validation, as pydantic reported it."""

    loc: tuple[str | int, ...]
    #: pydantic's message and error type (``missing``, ``extra_forbidden`` ...).
    message: str
    kind: str
    #: The value refused, or ``NO_INPUT`` when pydantic reported none.
    input: Any
    #: The environment variable that set the key ("" when none did).
    variable: str

    def describe(self) -> str:
        """``key: problem`` as ``load_config`` words it (``a.b.0.c: unknown key ...``)."""
        key = ".".join(str(p) for p in self.loc) or "(top level)"
        problem = self.message.removeprefix("Value error, ")
        if self.kind == "extra_forbidden":
            problem = "unknown key (check its spelling)"
        if self.variable:
            problem += f" (set by the environment variable {self.variable})"
        return f"{key}: {problem}"


#: ``ConfigProblem.input`` of an error without a value.
NO_INPUT = object()


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file, the key and the problem.

    ``problems`` lists the keys that failed validation (empty when the file could not be read
    or parsed), for callers that word them their own way (``launcher.deployment``).
    """

    def __init__(self, message: str, problems: Sequence[ConfigProblem] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


def read_config_data(path: str | Path, env_prefix: str | None = None) -> tuple[Any, Overrides]:
    """The JSON value in ``path`` with the environment's overrides of ``env_prefix`` applied,
    and which keys they set. Raises ``ConfigError`` naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    applied: Overrides = {}
    if env_prefix and isinstance(data, dict):
        try:
            applied = apply_env_overrides(data, env_prefix)
        except EnvOverrideError as exc:
            raise ConfigError(f"{path}: environment override {exc}") from None
    return data, applied


def load_config(path: str | Path, schema: type[ConfigT]) -> ConfigT:
    """Read ``path`` as JSON, apply the schema's environment overrides, validate.

    Raises ``ConfigError`` with a message such as
    ``configs/sb.json: batcher_config.package_max_workload: Input should be greater than 0``.
    """
    data, applied = read_config_data(path, getattr(schema, "env_prefix", None))
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        problems = [
            ConfigProblem(
                loc=tuple(err["loc"]),
                message=str(err["msg"]),
                kind=err["type"],
                input=err.get("input", NO_INPUT),
                variable=variable_for(tuple(err["loc"]), applied),
            )
            for err in exc.errors()
        ]
        message = "\n".join(f"{path}: {problem.describe()}" for problem in problems)
        raise ConfigError(message, problems) from None


def resolve_path(base_file: str | Path, value: str) -> str:
    """Resolve a relative path from a config: the current directory first, then the config's
    folder and the folder above it (configs/ usually sits in the project root)."""
    candidate = Path(value).expanduser()
    if candidate.is_absolute() or candidate.exists():
        return str(candidate)
    config_dir = Path(base_file).resolve().parent
    for folder in (config_dir, config_dir.parent):
        if (folder / candidate).exists():
            return str(folder / candidate)
    return str(candidate)
