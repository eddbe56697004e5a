"""The run folder: where the launcher keeps what it started, for any later shell to find.

For each app ``NAME`` it holds a record ``NAME.json`` (an :class:`AppRecord`), the pid file
``NAME.pid`` and the log ``logs/NAME.log``; ``.start.lock`` keeps two starts apart. The folder
is ``--run-dir``, else ``$LLM_SUITE_RUN_DIR``, else the deployment's ``run_dir``, else
``<repo>/run`` (installed from a wheel: ``~/.local/state/llm-suite/run``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from launcher.console import StartAppError
from launcher.deployment import REPO_ROOT, Deployment, base_url, resolve_path

RUN_DIR_ENV: str = "LLM_SUITE_RUN_DIR"


class AppRecord(BaseModel):
    """What ``RUN/NAME.json`` remembers about a started app."""

    model_config = ConfigDict(extra="ignore")

    name: str
    app: str | None
    module: str
    config: str | None
    host: str
    port: int
    workers: int
    pid: int
    pgid: int
    log_file: str
    pid_file: str
    started_at: float
    command: list[str]
    #: Records written before the chat UI existed have no such key: they were all /health.
    health_path: str = "/health"

    @property
    def url(self) -> str:
        """Base URL clients use to reach the app."""
        return base_url(self.host, self.port)


def resolve_run_dir(cli_value: str | None = None, deployment: Deployment | None = None) -> Path:
    """Pick the run folder: ``--run-dir``, then ``$LLM_SUITE_RUN_DIR``, deployment, default."""
    if cli_value:
        return resolve_path(cli_value)
    env_value = os.environ.get(RUN_DIR_ENV)
    if env_value:
        return resolve_path(env_value)
    if deployment is not None and deployment.run_dir:
        return resolve_path(deployment.run_dir)
    return default_run_dir()


def default_run_dir() -> Path:
    """``<repo>/run`` in a source checkout; installed from a wheel, where the code sits in
    site-packages, the user's state folder (``$XDG_STATE_HOME/llm-suite/run``)."""
    if (REPO_ROOT / "pyproject.toml").is_file():
        return REPO_ROOT / "run"
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state) / "llm-suite" / "run"


def record_path(run_dir: Path, name: str) -> Path:
    """Where the record of app ``name`` lives."""
    return run_dir / f"{name}.json"


def pid_path(run_dir: Path, name: str) -> Path:
    """Where gunicorn writes the master pid of app ``name``."""
    return run_dir / f"{name}.pid"


def log_path(run_dir: Path, name: str) -> Path:
    """Where the output of app ``name`` goes."""
    return run_dir / "logs" / f"{name}.log"


def read_record(run_dir: Path, name: str) -> AppRecord | None:
    """Return the record of ``name``, or None when there is none (or it is unreadable)."""
    path = record_path(run_dir, name)
    try:
        return AppRecord.model_validate_json(path.read_text())
    except (OSError, ValidationError, ValueError):
        return None


def list_records(run_dir: Path) -> list[AppRecord]:
    """All readable records in ``run_dir``, oldest start first."""
    records = []
    if run_dir.is_dir():
        for path in run_dir.glob("*.json"):
            record = read_record(run_dir, path.stem)
            if record is not None:
                records.append(record)
    return sorted(records, key=lambda r: r.started_at)


def remove_record(run_dir: Path, name: str) -> None:
    """Forget app ``name``: its record, pid file and gunicorn control socket."""
    for path in (record_path(run_dir, name), pid_path(run_dir, name), run_dir / f"{name}.ctl"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def start_lock(run_dir: Path) -> Iterator[None]:
    """Refuse two concurrent ``up``/``start`` runs on one run folder (they would race on ports)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".start.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StartAppError(
                f"another start_app.py up/start is running on {run_dir}; wait for it to finish"
            ) from None
        yield
