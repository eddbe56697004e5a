"""The launcher's commands: ``up``, ``down``, ``status``, ``start``, ``stop`` and ``logs``.

Each ``cmd_*`` takes the parsed arguments and returns the exit code. ``up`` and ``start`` hand
their apps to ``startup.bring_up``; ``down`` and ``stop`` use ``processes.stop_record``; the
run folder comes from ``--run-dir``, the environment or the deployment (``rundir``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from launcher.console import StartAppError, err, say, tail_lines
from launcher.deployment import (
    APP_KINDS,
    DEFAULT_DEPLOYMENT,
    AppEntry,
    Deployment,
    base_url,
    format_loc,
    load_deployment,
    resolve_path,
)
from launcher.processes import is_ours, pid_alive, stop_record
from launcher.rundir import list_records, log_path, read_record, resolve_run_dir
from launcher.startup import bring_up, probe_health
from launcher.wiring_check import unmatched_gateway_urls, warn
from utils.deployment_apps import DEPLOYMENT_FILE_ENV


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
    deployment_file = resolve_path(args.deployment or DEFAULT_DEPLOYMENT)
    deployment = load_deployment(deployment_file)
    run_dir = resolve_run_dir(args.run_dir, deployment)
    entries = [_with_deployment_env(e, deployment_file) for e in deployment.apps if e.enabled]
    if not entries:
        say("the deployment enables no app; nothing to do")
        return 0
    code = bring_up(entries, run_dir, args.timeout)
    if code == 0:
        say()
        _print_status(run_dir, None)
        say()
        for warning in unmatched_gateway_urls(deployment.apps, deployment_file):
            warn(warning)
        say(f"all up. Stop with: python {Path(sys.argv[0]).name} down")
    return code


def _with_deployment_env(entry: AppEntry, deployment_file: Path) -> AppEntry:
    """The entry with ``$LLM_SUITE_DEPLOYMENT_FILE`` set: a gateway's config that names its
    servers by app name resolves them from the deployment it was started from."""
    env = {DEPLOYMENT_FILE_ENV: str(deployment_file), **entry.env}
    return entry.model_copy(update={"env": env})


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
    deployment_file = resolve_path(args.deployment) if args.deployment else DEFAULT_DEPLOYMENT
    if args.deployment or DEFAULT_DEPLOYMENT.exists():
        deployment = load_deployment(deployment_file)
    base: dict[str, Any] | None = None
    if deployment is not None:
        for entry in deployment.apps:
            if entry.name == args.app:
                base = _with_deployment_env(entry, deployment_file).model_dump()
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
