#!/usr/bin/env python3
"""Launch, watch and stop the suite's apps: gunicorn masters with uvicorn workers, in background.

Every app (the gateway ``client`` and the servers ``cb_server`` / ``sb_server``) runs as::

    <python> -m gunicorn "MODULE:build_app('CONFIG')" --worker-class uvicorn_worker.UvicornWorker \
        --bind HOST:PORT --workers N --timeout 600 --graceful-timeout 30 --pid RUN/NAME.pid

in a session of its own, with stdout/stderr in ``RUN/logs/NAME.log`` and a record in
``RUN/NAME.json`` so that ``down``, ``stop`` and ``status`` find it again from another shell.
The chat front end (``chat_ui``, the optional ``ui`` extra) is no ASGI app: it runs as
``<python> -m streamlit run chat_ui_app.py --server.headless true ...`` with the same pid, log
and record files; its gateway is ``$LLM_SUITE_GATEWAY_URL`` (the entry's ``env``).
``RUN`` is ``<repo>/run`` unless ``--run-dir``, the environment variable ``LLM_SUITE_RUN_DIR``
or the deployment's ``run_dir`` says otherwise (in that order of precedence).

Deployments are JSON files (``configs/deployment.json`` by default) validated by the pydantic
models in ``utils/launcher/deployment.py``; relative paths in them are relative to the
repository root.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from utils.launcher.console import (
    StartAppError,
    err,
    print_log_tail,
    say,
    tail_lines,
)
from utils.launcher.deployment import (
    APP_KINDS,
    DEFAULT_DEPLOYMENT,
    DEFAULT_HEALTH_TIMEOUT,
    REPO_ROOT,
    ROLE_ORDER,
    AppEntry,
    Deployment,
    base_url,
    bind_address,
    format_loc,
    load_deployment,
    resolve_path,
)
from utils.launcher.processes import (
    STOP_GRACE_SECONDS,
    is_ours,
    pid_alive,
    stop_record,
)
from utils.launcher.rundir import (
    RUN_DIR_ENV,
    AppRecord,
    list_records,
    log_path,
    pid_path,
    read_record,
    record_path,
    resolve_run_dir,
    start_lock,
)


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
        "uvicorn_worker.UvicornWorker",
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


def _deployment_for_run_dir(args: argparse.Namespace) -> Deployment | None:
    """The deployment, read only to learn its run_dir; a broken or absent file is no obstacle."""
    path = args.deployment or (DEFAULT_DEPLOYMENT if DEFAULT_DEPLOYMENT.exists() else None)
    if path is None:
        return None
    try:
        return load_deployment(path)
    except StartAppError:
        return None


def cmd_up(args: argparse.Namespace) -> int:
    """``up``: start every enabled app of the deployment."""
    deployment = load_deployment(args.deployment or DEFAULT_DEPLOYMENT)
    run_dir = resolve_run_dir(args.run_dir, deployment)
    entries = [e for e in deployment.apps if e.enabled]
    if not entries:
        say("the deployment enables no app; nothing to do")
        return 0
    code = bring_up(entries, run_dir, args.timeout)
    if code == 0:
        say()
        _print_status(run_dir, None)
        say()
        say(f"all up. Stop with: python {Path(sys.argv[0]).name} down")
    return code


def _stop_all(run_dir: Path) -> int:
    records = list_records(run_dir)
    if not records:
        say(f"nothing recorded in {run_dir}: nothing to stop")
        return 0
    ok = True
    # Reverse start order: the gateway goes first, so it stops sending work to the servers.
    for record in reversed(records):
        ok = stop_record(record, run_dir) and ok
    return 0 if ok else 1


def cmd_down(args: argparse.Namespace) -> int:
    """``down``: stop every app recorded in the run folder."""
    run_dir = resolve_run_dir(args.run_dir, _deployment_for_run_dir(args))
    say(f"stopping apps recorded in {run_dir}")
    return _stop_all(run_dir)


def _status_rows(run_dir: Path, deployment: Deployment | None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    recorded = {r.name: r for r in list_records(run_dir)}
    for record in recorded.values():
        alive = pid_alive(record.pid) and is_ours(record)
        status, text = probe_health(record.url, path=record.health_path) if alive else (None, "-")
        rows.append(
            {
                "name": record.name,
                "pid": record.pid,
                "alive": alive,
                "url": record.url,
                "health_status": status,
                "health": f"{status} {text}" if status is not None else text,
            }
        )
    if deployment is not None:
        for entry in deployment.apps:
            if entry.enabled and entry.name not in recorded:
                rows.append(
                    {
                        "name": entry.name,
                        "pid": None,
                        "alive": False,
                        "url": base_url(entry.host, entry.port),
                        "health_status": None,
                        "health": "not started",
                    }
                )
    return rows


def _print_status(run_dir: Path, deployment: Deployment | None, as_json: bool = False) -> None:
    rows = _status_rows(run_dir, deployment)
    if as_json:
        print(json.dumps(rows, indent=2), flush=True)
        return
    if not rows:
        say(f"no apps recorded in {run_dir}")
        return
    header = ["APP", "PID", "ALIVE", "URL", "/health"]
    table = [
        [r["name"], str(r["pid"] or "-"), "yes" if r["alive"] else "no", r["url"], r["health"]]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, *table]:
        say("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def cmd_status(args: argparse.Namespace) -> int:
    """``status``: one line per app with pid, liveness, URL and the /health answer."""
    deployment = _deployment_for_run_dir(args)
    run_dir = resolve_run_dir(args.run_dir, deployment)
    _print_status(run_dir, deployment, as_json=args.json)
    return 0


def _entry_for_start(args: argparse.Namespace) -> tuple[AppEntry, Deployment | None]:
    """Build the entry for ``start``: deployment entry or built-in defaults, then CLI options."""
    deployment: Deployment | None = None
    if args.deployment:
        deployment = load_deployment(args.deployment)
    elif DEFAULT_DEPLOYMENT.exists():
        deployment = load_deployment(DEFAULT_DEPLOYMENT)
    base: dict[str, Any] | None = None
    if deployment is not None:
        for entry in deployment.apps:
            if entry.name == args.app:
                base = entry.model_dump()
                break
    if base is None and args.app in APP_KINDS:
        kind = APP_KINDS[args.app]
        base = {"name": args.app, "app": args.app, "config": kind.default_config}
        base["port"] = kind.default_port
    if base is None:
        if not args.module:
            raise StartAppError(
                f"unknown app {args.app!r}: use one of {', '.join(APP_KINDS)}, a name from the "
                "deployment file, or give --module"
            )
        base = {"name": args.app}
    overrides = {
        "config": args.config,
        "host": args.host,
        "port": args.port,
        "workers": args.workers,
        "module": args.module,
        "pythonpath": args.pythonpath,
    }
    base.update({k: v for k, v in overrides.items() if v is not None})
    base["enabled"] = True
    try:
        return AppEntry.model_validate(base), deployment
    except ValidationError as exc:
        problems = "; ".join(f"{format_loc(e['loc'])}: {e['msg']}" for e in exc.errors())
        raise StartAppError(f"cannot start {args.app!r}: {problems}") from None


def cmd_start(args: argparse.Namespace) -> int:
    """``start APP``: start one app and wait for its /health."""
    entry, deployment = _entry_for_start(args)
    run_dir = resolve_run_dir(args.run_dir, deployment)
    return bring_up([entry], run_dir, args.timeout)


def cmd_stop(args: argparse.Namespace) -> int:
    """``stop APP``: stop one recorded app."""
    run_dir = resolve_run_dir(args.run_dir, _deployment_for_run_dir(args))
    record = read_record(run_dir, args.app)
    if record is None:
        known = ", ".join(r.name for r in list_records(run_dir)) or "none"
        err(f"no record of {args.app!r} in {run_dir} (recorded apps: {known})")
        return 1
    return 0 if stop_record(record, run_dir) else 1


def cmd_logs(args: argparse.Namespace) -> int:
    """``logs APP``: print the end of an app's log, optionally following it."""
    run_dir = resolve_run_dir(args.run_dir, _deployment_for_run_dir(args))
    path = log_path(run_dir, args.app)
    if not path.exists():
        logs = sorted(p.stem for p in (run_dir / "logs").glob("*.log"))
        err(f"no log file {path} (logs: {', '.join(logs) or 'none'})")
        return 1
    for line in tail_lines(path, args.lines):
        print(line)
    sys.stdout.flush()
    if not args.follow:
        return 0
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            while True:
                chunk = handle.read()
                if chunk:
                    sys.stdout.write(chunk.decode("utf-8", errors="replace"))
                    sys.stdout.flush()
                else:
                    time.sleep(0.5)
    except KeyboardInterrupt:
        return 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--run-dir",
        help=f"pid/log folder (default: ${RUN_DIR_ENV}, else the deployment's run_dir, "
        "else <repo>/run)",
    )
    common.add_argument(
        "--deployment",
        help=f"deployment file (default: {DEFAULT_DEPLOYMENT.relative_to(REPO_ROOT)})",
    )

    parser = argparse.ArgumentParser(
        prog="start_app.py",
        description="Run the suite's apps (gateway, servers, chat UI) in the background.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(
            [
                "apps (APP):",
                *(
                    f"  {name:<10} {kind.module} (default port {kind.default_port})"
                    for name, kind in APP_KINDS.items()
                ),
                "",
                "examples:",
                "  python start_app.py up         # every enabled app of configs/deployment.json",
                "  python start_app.py status",
                "  python start_app.py logs client -n 100 -f",
                "  python start_app.py start sb_server --port 8012 --workers 2",
                "  python start_app.py down",
                "",
                f"environment: {RUN_DIR_ENV} sets the pid/log folder (default <repo>/run).",
                "Run '<command> --help' for the options of a command.",
            ]
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser(
        "up",
        parents=[common],
        help="start every enabled app of the deployment (servers first, then the gateway)",
        description="Start every enabled app of the deployment, each healthy before the next; "
        "on failure, say why, show the log tail and stop what was started.",
    )
    up.add_argument(
        "--timeout",
        type=float,
        help="seconds to wait for each app's /health (default: the entry's "
        f"health_timeout_seconds, {DEFAULT_HEALTH_TIMEOUT:.0f})",
    )
    up.set_defaults(func=cmd_up)

    down = sub.add_parser(
        "down",
        parents=[common],
        help="stop every app recorded in the run folder",
        description=(
            f"SIGTERM each recorded gunicorn master, wait up to {STOP_GRACE_SECONDS:.0f} s, "
            "then SIGKILL its process group; remove pid and record files."
        ),
    )
    down.set_defaults(func=cmd_down)

    status = sub.add_parser(
        "status", parents=[common], help="show app, pid, alive, url and /health answer"
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)

    start = sub.add_parser(
        "start",
        parents=[common],
        help="start one app",
        description="Start one app. Settings come from its deployment entry (if the deployment "
        "file has one of that name), else from built-in defaults; options override them.",
    )
    start.add_argument("app", metavar="APP", help=f"one of {', '.join(APP_KINDS)} or a name")
    start.add_argument("--config", help="config file passed to build_app")
    start.add_argument("--host", help="address to bind (default 127.0.0.1)")
    start.add_argument("--port", type=int, help="port to bind")
    start.add_argument("--workers", type=int, help="gunicorn worker processes (default 1)")
    start.add_argument("--module", help="import build_app from this module instead")
    start.add_argument(
        "--pythonpath", action="append", help="folder to put on PYTHONPATH (repeatable)"
    )
    start.add_argument("--timeout", type=float, help="seconds to wait for /health")
    start.set_defaults(func=cmd_start)

    stop = sub.add_parser("stop", parents=[common], help="stop one app")
    stop.add_argument("app", metavar="APP", help="name of a recorded app")
    stop.set_defaults(func=cmd_stop)

    logs = sub.add_parser("logs", parents=[common], help="show the end of an app's log")
    logs.add_argument("app", metavar="APP", help="name of the app")
    logs.add_argument("-n", "--lines", type=int, default=50, help="lines to show (default 50)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.set_defaults(func=cmd_logs)
    return parser


def _absolute_cli_paths(args: argparse.Namespace) -> None:
    """Paths typed on the command line (or in the environment) are relative to the cwd.

    Only paths inside deployment files are repo-relative, so that a deployment works from
    anywhere; making the others absolute here keeps resolve_path() from re-rooting them.
    """
    for key in ("deployment", "run_dir", "config"):
        value = getattr(args, key, None)
        if value:
            setattr(args, key, os.path.abspath(os.path.expanduser(value)))
    if getattr(args, "pythonpath", None):
        args.pythonpath = [os.path.abspath(os.path.expanduser(p)) for p in args.pythonpath]
    if os.environ.get(RUN_DIR_ENV):
        os.environ[RUN_DIR_ENV] = os.path.abspath(os.path.expanduser(os.environ[RUN_DIR_ENV]))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    _absolute_cli_paths(args)
    try:
        return int(args.func(args))
    except StartAppError as exc:
        err(str(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
