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
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from utils.launcher.console import (
    StartAppError,
    err,
    say,
    tail_lines,
)
from utils.launcher.deployment import (
    APP_KINDS,
    DEFAULT_DEPLOYMENT,
    DEFAULT_HEALTH_TIMEOUT,
    REPO_ROOT,
    AppEntry,
    Deployment,
    base_url,
    format_loc,
    load_deployment,
)
from utils.launcher.deployment import ROLE_ORDER as ROLE_ORDER
from utils.launcher.processes import (
    STOP_GRACE_SECONDS,
    is_ours,
    pid_alive,
    stop_record,
)
from utils.launcher.rundir import (
    RUN_DIR_ENV,
    list_records,
    log_path,
    read_record,
    resolve_run_dir,
)
from utils.launcher.startup import bring_up, probe_health


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
