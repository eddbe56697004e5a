"""The deployment file: the suite's app kinds, the entries that run them, and reading one.

A deployment (``configs/deployment.json`` by default) lists the apps to run, each with host,
port, workers, config and environment. Relative paths in it are relative to the repository
root, so that it works from any folder; ``LLM_SUITE_DEPLOYMENT__...`` variables override its
keys (``LLM_SUITE_DEPLOYMENT__APPS__CB_SERVER__PORT=9001``, see ``utils.env_overrides``).
:func:`load_deployment` turns any problem with the file into a :class:`StartAppError` that
names the file, the key and what is wrong.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from launcher.console import StartAppError
from utils.config import NO_INPUT, ConfigError, ConfigProblem, load_config

# Re-exported: the launcher's modules and start_app import base_url from here.
from utils.deployment_apps import DEPLOYMENT_ENV_PREFIX
from utils.deployment_apps import base_url as base_url

REPO_ROOT: Path = Path(__file__).resolve().parents[1]
DEFAULT_DEPLOYMENT: Path = REPO_ROOT / "configs" / "deployment.json"
DEFAULT_HEALTH_TIMEOUT: float = 180.0

AppKindName = Literal["client", "cb_server", "sb_server", "embedding_server", "chat_ui"]


@dataclass(frozen=True)
class AppKind:
    """What start_app knows about one of the suite's apps."""

    module: str
    default_config: str | None
    default_port: int
    #: Servers start before the gateway, so that its first heartbeat already finds them, and
    #: the UI after it, so that its first page lists the models.
    role: Literal["server", "gateway", "ui"]
    #: gunicorn serves ``MODULE:build_app(CONFIG)``; streamlit runs the file ``MODULE.py``.
    launcher: Literal["gunicorn", "streamlit"] = "gunicorn"
    health_path: str = "/health"


APP_KINDS: dict[str, AppKind] = {
    "client": AppKind("client_app", "configs/client_config.json", 8000, "gateway"),
    "cb_server": AppKind(
        "continuous_batching_server_app", "configs/cb_server_config.json", 8001, "server"
    ),
    "sb_server": AppKind(
        "static_batching_server_app", "configs/sb_server_config.json", 8002, "server"
    ),
    "embedding_server": AppKind(
        "embedding_server_app", "configs/embedding_server_config.json", 8003, "server"
    ),
    "chat_ui": AppKind(
        "chat_ui_app", None, 8501, "ui", launcher="streamlit", health_path="/_stcore/health"
    ),
}
#: Start order by role (sorted() is stable: file order within a role).
ROLE_ORDER: dict[str, int] = {"server": 0, "gateway": 1, "ui": 2}


# Names become file names in the run folder: keep them to a safe alphabet.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
MODULE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


class AppEntry(BaseModel):
    """One app of a deployment file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description="unique name: record, pid and log files")
    app: AppKindName | None = Field(default=None, description="which app of the suite to run")
    module: str | None = Field(
        default=None,
        pattern=MODULE_PATTERN,
        description="import this module's build_app instead of the app's own (tests, plugins)",
    )
    config: str | None = Field(default=None, description="config file passed to build_app")
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    workers: int = Field(default=1, ge=1, le=64)
    enabled: bool = True
    pythonpath: list[str] = Field(
        default_factory=list, description="folders put in front of PYTHONPATH for this app"
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")
    health_timeout_seconds: float = Field(default=DEFAULT_HEALTH_TIMEOUT, gt=0)

    @model_validator(mode="after")
    def _app_or_module(self) -> AppEntry:
        if self.app is None and self.module is None:
            raise ValueError(f"give 'app' (one of {', '.join(APP_KINDS)}) or 'module'")
        if self.launcher == "streamlit" and (self.config or self.workers != 1):
            raise ValueError(
                f"app {self.app!r} takes no config file and runs one process (workers 1); "
                "point it at a gateway with env LLM_SUITE_GATEWAY_URL"
            )
        return self

    @property
    def module_name(self) -> str:
        """The Python module whose ``build_app`` gunicorn imports."""
        if self.module:
            return self.module
        assert self.app is not None  # guaranteed by _app_or_module
        return APP_KINDS[self.app].module

    @property
    def role(self) -> str:
        """``gateway`` for the client app, ``ui`` for the chat UI, ``server`` otherwise."""
        return APP_KINDS[self.app].role if self.app else "server"

    @property
    def launcher(self) -> str:
        """``gunicorn`` for the ASGI apps, ``streamlit`` for the chat UI."""
        return APP_KINDS[self.app].launcher if self.app else "gunicorn"

    @property
    def health_path(self) -> str:
        """The path that answers 200 once the app is ready."""
        return APP_KINDS[self.app].health_path if self.app else "/health"


class Deployment(BaseModel):
    """A deployment file: which apps to run, where, with which configs; ``LLM_SUITE_DEPLOYMENT``
    variables override its keys."""

    model_config = ConfigDict(extra="forbid")
    env_prefix: ClassVar[str] = DEPLOYMENT_ENV_PREFIX

    run_dir: str | None = Field(default=None, description="pid/log folder (default <repo>/run)")
    apps: list[AppEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Deployment:
        names = [a.name for a in self.apps]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"app names must be unique; repeated: {', '.join(duplicates)}")
        seen: dict[int, str] = {}
        for entry in self.apps:
            if not entry.enabled:
                continue
            if entry.port in seen:
                raise ValueError(
                    f"enabled apps {seen[entry.port]!r} and {entry.name!r} "
                    f"both use port {entry.port}"
                )
            seen[entry.port] = entry.name
        return self


def resolve_path(value: str | os.PathLike[str]) -> Path:
    """Resolve a path from a deployment file: relative means relative to the repository root."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (REPO_ROOT / path)


def format_loc(loc: Sequence[int | str]) -> str:
    """A pydantic error location as a key path, e.g. ``apps[0].port``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def load_deployment(path: str | os.PathLike[str]) -> Deployment:
    """Read and validate a deployment file (``utils.config.load_config``, overrides included).

    Raises :class:`StartAppError` whose message names the file, the key and the problem.
    """
    file = resolve_path(path)
    try:
        return load_config(file, Deployment)
    except ConfigError as exc:
        if not exc.problems:  # unreadable, not JSON, or a bad override: one line naming it
            raise StartAppError(f"deployment file {exc}") from None
        lines = [f"bad deployment file {file}:", *(f"  {_describe(p)}" for p in exc.problems)]
        raise StartAppError("\n".join(lines)) from None


def _describe(problem: ConfigProblem) -> str:
    """One key's problem, worded for the launcher: ``apps[0].port: ... (got ...)``."""
    detail = problem.message
    if problem.kind != "missing" and problem.input is not NO_INPUT:
        detail += f" (got {json.dumps(problem.input, default=str)[:80]})"
    if problem.variable:
        detail += f" (set by the environment variable {problem.variable})"
    return f"{format_loc(problem.loc)}: {detail}"


def bind_address(host: str, port: int) -> str:
    """gunicorn's --bind value (IPv6 literals need brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
