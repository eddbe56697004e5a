"""Starting one app in the background: its command line, its environment, its record.

ASGI apps run as ``python -m gunicorn "MODULE:build_app('CONFIG')"`` with uvicorn workers; the
chat UI runs as ``python -m streamlit run chat_ui_app.py``. Either way the process gets a
session of its own, its output goes to the app's log, and its record is written at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.deployment import REPO_ROOT, AppEntry, bind_address, resolve_path
from launcher.rundir import AppRecord, log_path, pid_path, record_path


@dataclass
class StartedApp:
    """An app launched by this process (the Popen handle lets us reap and poll it)."""

    entry: AppEntry
    record: AppRecord
    popen: subprocess.Popen[bytes]


def build_command(entry: AppEntry, run_dir: Path) -> list[str]:
    """The gunicorn (or, for the chat UI, streamlit) command line for ``entry``."""
    if entry.launcher == "streamlit":
        return build_streamlit_command(entry)
    config = str(resolve_path(entry.config)) if entry.config else None
    # gunicorn parses "module:func(args)" with ast.literal_eval: repr() gives a safe literal.
    target = (
        f"{entry.module_name}:build_app({config!r})"
        if config
        else f"{entry.module_name}:build_app()"
    )
    return [
        sys.executable,
        "-m",
        "gunicorn",
        target,
        "--worker-class",
        "utils.serving.HardenedUvicornWorker",
        "--bind",
        bind_address(entry.host, entry.port),
        "--workers",
        str(entry.workers),
        "--timeout",
        "600",
        "--graceful-timeout",
        "30",
        "--pid",
        str(pid_path(run_dir, entry.name)),
        "--error-logfile",
        "-",
        "--access-logfile",
        "-",
        *_control_socket_args(run_dir, entry.name),
    ]


def build_streamlit_command(entry: AppEntry) -> list[str]:
    """``streamlit run`` of the app's script, headless, without telemetry or file watching."""
    script = REPO_ROOT / (entry.module_name.replace(".", "/") + ".py")
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(script),
        "--server.headless",
        "true",
        "--server.address",
        entry.host,
        "--server.port",
        str(entry.port),
        "--browser.gatherUsageStats",
        "false",
        # Reruns on file change are for development; a deployment serves the file it started with.
        "--server.fileWatcherType",
        "none",
        "--client.toolbarMode",
        "viewer",
    ]


def _control_socket_args(run_dir: Path, name: str) -> list[str]:
    """Give each master its own control socket (gunicorn >= 24 has one).

    By default every master on the machine would share ``~/.gunicorn/gunicorn.ctl``. Unix socket
    paths are limited to about 107 bytes, so a deep run folder gets none at all.
    """
    try:
        from gunicorn.config import KNOWN_SETTINGS
    except ImportError:
        return []
    if "control_socket" not in {setting.name for setting in KNOWN_SETTINGS}:
        return []
    socket_path = run_dir / f"{name}.ctl"
    if len(str(socket_path).encode()) < 100:
        return ["--control-socket", str(socket_path)]
    return ["--no-control-socket"]


def build_env(entry: AppEntry) -> dict[str, str]:
    """Environment of an app: ours, offline model hub, repo and extra folders on PYTHONPATH."""
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",  # log lines reach the log file as they happen
            "LLM_SUITE_APP_NAME": entry.name,
        }
    )
    paths = [str(resolve_path(p)) for p in entry.pythonpath] + [str(REPO_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(entry.env)
    return env


def start_entry(entry: AppEntry, run_dir: Path) -> StartedApp:
    """Launch one app in the background and write its record (does not wait for health)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_file = log_path(run_dir, entry.name)
    if log_file.exists():
        # Keep one previous log; the fresh one then shows only this run (its tail is the story).
        log_file.replace(log_file.with_suffix(".log.1"))
    command = build_command(entry, run_dir)
    with open(log_file, "ab") as log:
        log.write(f"# start_app: {' '.join(command)}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=build_env(entry),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # A session of its own: Ctrl-C in this shell does not reach the app, and the app's
            # process group (master + workers) can be killed as one.
            start_new_session=True,
        )
    record = AppRecord(
        name=entry.name,
        app=entry.app,
        module=entry.module_name,
        config=str(resolve_path(entry.config)) if entry.config else None,
        host=entry.host,
        port=entry.port,
        workers=entry.workers,
        pid=popen.pid,
        pgid=popen.pid,
        log_file=str(log_file),
        pid_file=str(pid_path(run_dir, entry.name)),
        started_at=time.time(),
        command=command,
        health_path=entry.health_path,
    )
    if entry.launcher != "gunicorn":
        # gunicorn writes its own pid file; streamlit does not, and its process is the app.
        Path(record.pid_file).write_text(f"{popen.pid}\n")
    # Written at once, so that `down` finds the app even if this process is interrupted.
    tmp = record_path(run_dir, entry.name).with_suffix(".json.tmp")
    tmp.write_text(record.model_dump_json(indent=2) + "\n")
    tmp.replace(record_path(run_dir, entry.name))
    return StartedApp(entry=entry, record=record, popen=popen)
