"""Bringing apps up: check that each can start, then start them in order, each healthy first.

Before any start: every app's config file exists, streamlit is installed for the chat UI, and
its port is free. Then servers, the gateway and the UI start in that order, each waited for
until its health path answers 200; when one fails, what this run started is stopped again.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from launcher.console import err, print_log_tail, say
from launcher.deployment import ROLE_ORDER, AppEntry, bind_address, resolve_path
from launcher.launch import StartedApp, start_entry
from launcher.processes import is_ours, pid_alive, stop_record
from launcher.rundir import read_record, start_lock


def port_problem(host: str, port: int) -> str | None:
    """Return why ``host:port`` cannot be used by a new app, or None if it is free."""
    connect_host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Something answering there is a clear "taken", whatever the bind test says.
    with socket.socket(socket.AF_INET6 if ":" in connect_host else socket.AF_INET) as probe:
        probe.settimeout(0.5)
        if probe.connect_ex((connect_host, port)) == 0:
            return f"port {port} on {host} is already in use (something accepts connections)"
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Like gunicorn, tolerate TIME_WAIT leftovers of a previous run.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return f"cannot bind {bind_address(host, port)}: {exc.strerror or exc}"
    return None


def preflight(entry: AppEntry) -> str | None:
    """Return why ``entry`` cannot start (missing config or package, taken port), or None."""
    if entry.config and not resolve_path(entry.config).is_file():
        return f"config file {resolve_path(entry.config)} does not exist"
    if entry.launcher == "streamlit" and importlib.util.find_spec("streamlit") is None:
        return (
            f"streamlit is not installed in {sys.prefix}: pip install -e '.[ui]' "
            f"(or disable the {entry.name!r} entry)"
        )
    return port_problem(entry.host, entry.port)


def probe_health(url: str, timeout: float = 2.0, path: str = "/health") -> tuple[int | None, str]:
    """GET ``url`` + ``path``; return (status code or None, short text)."""
    import httpx  # imported here: `down` and `--help` stay fast

    try:
        # trust_env=False: a proxy from the environment must not intercept loopback calls.
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            response = client.get(f"{url}{path}")
    except httpx.HTTPError as exc:
        return None, type(exc).__name__
    body = " ".join(response.text.split())
    return response.status_code, body[:60] + ("..." if len(body) > 60 else "")


def wait_healthy(started: StartedApp, timeout: float) -> tuple[bool, str]:
    """Wait until the app's /health answers 200, its process dies, or ``timeout`` passes."""
    start = time.monotonic()
    last = "no answer yet"
    while True:
        code = started.popen.poll()
        if code is not None:
            return False, f"its process exited with code {code} before /health answered"
        status, text = probe_health(started.record.url, path=started.record.health_path)
        if status == 200:
            return True, f"healthy after {time.monotonic() - start:.1f} s"
        if status is not None:
            last = f"HTTP {status} {text}"
        elif text:
            last = text
        if time.monotonic() - start > timeout:
            return False, f"/health did not answer 200 within {timeout:.0f} s (last: {last})"
        time.sleep(0.3)


def bring_up(entries: Sequence[AppEntry], run_dir: Path, timeout: float | None = None) -> int:
    """Start ``entries`` (servers first, then the gateway), each healthy before the next.

    On any failure, stops what this call started and returns 1; returns 0 on success.
    ``timeout`` overrides each entry's ``health_timeout_seconds``.
    """
    ordered = sorted(entries, key=lambda e: ROLE_ORDER[e.role])  # stable: file order kept
    with start_lock(run_dir):
        running: set[str] = set()
        problems: list[str] = []
        for entry in ordered:
            record = read_record(run_dir, entry.name)
            if record and pid_alive(record.pid) and is_ours(record):
                running.add(entry.name)
                continue
            problem = preflight(entry)
            if problem:
                problems.append(f"app {entry.name!r} (port {entry.port}): {problem}")
        if problems:
            for problem in problems:
                err(problem)
            err("nothing was started")
            return 1

        started: list[StartedApp] = []
        try:
            for entry in ordered:
                if entry.name in running:
                    say(f"{entry.name}: already running, left as it is")
                    continue
                say(
                    f"{entry.name}: starting {entry.module_name} on "
                    f"{bind_address(entry.host, entry.port)} "
                    f"(workers {entry.workers}, config {entry.config or '-'})"
                )
                app = start_entry(entry, run_dir)
                started.append(app)
                say(f"{entry.name}: pid {app.record.pid}, log {app.record.log_file}")
                ok, why = wait_healthy(app, timeout or entry.health_timeout_seconds)
                if not ok:
                    err(f"app {entry.name!r} ({app.record.url}) failed to start: {why}")
                    print_log_tail(app.record.log_file)
                    _stop_started(started, run_dir)
                    return 1
                say(f"{entry.name}: {why} at {app.record.url}")
        except KeyboardInterrupt:
            err("interrupted")
            _stop_started(started, run_dir)
            return 130
        except OSError as exc:
            err(f"could not launch: {exc}")
            _stop_started(started, run_dir)
            return 1
    return 0


def _stop_started(started: list[StartedApp], run_dir: Path) -> None:
    if started:
        say("stopping what this run started:")
    for app in reversed(started):
        stop_record(app.record, run_dir, popen=app.popen)
