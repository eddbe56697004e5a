"""Loading JSON configs into pydantic models with errors that name file, key and problem.

A schema with a ``env_prefix`` class variable takes overrides from the environment
(``utils.env_overrides``); an error at an overridden key names the variable too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from utils.env_overrides import EnvOverrideError, apply_env_overrides, variable_for

ConfigT = TypeVar("ConfigT", bound=BaseModel)


class ConfigSection(BaseModel):
    """Base of every section of the servers' config files.

    Unknown keys are refused, so a misspelt key stops start-up with a message naming it
    (``load_config`` words it "unknown key") instead of being silently ignored. The
    ``model_`` namespace is open because keys such as ``model_name_or_path`` and
    ``model_loading_config`` come from the seed's config files.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file, the key and the problem."""


def load_config(path: str | Path, schema: type[ConfigT]) -> ConfigT:
    """Read ``path`` as JSON, apply the schema's environment overrides, validate.

    Raises ``ConfigError`` with a message such as
    ``configs/sb.json: batcher_config.package_max_workload: Input should be greater than 0``.
    """
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
    prefix = getattr(schema, "env_prefix", None)
    applied: dict[tuple[str | int, ...], str] = {}
    if prefix and isinstance(data, dict):
        try:
            applied = apply_env_overrides(data, prefix)
        except EnvOverrideError as exc:
            raise ConfigError(f"{path}: environment override {exc}") from None
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(top level)"
            problem = str(err["msg"]).removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                problem = "unknown key (check its spelling)"
            variable = variable_for(tuple(err["loc"]), applied)
            if variable:
                problem += f" (set by the environment variable {variable})"
            problems.append(f"{path}: {key}: {problem}")
        raise ConfigError("\n".join(problems)) from None


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
