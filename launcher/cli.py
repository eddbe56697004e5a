"""The command line of ``llm-suite`` (and ``start_app.py``): the argument parser and ``main``.

``main`` parses the arguments, makes the paths typed on the command line absolute, runs the
command and turns a :class:`StartAppError` into one ``error:`` line and exit code 1.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from launcher.commands import cmd_down, cmd_logs, cmd_start, cmd_status, cmd_stop, cmd_up
from launcher.console import StartAppError, err
from launcher.deployment import (
    APP_KINDS,
    DEFAULT_DEPLOYMENT,
    DEFAULT_HEALTH_TIMEOUT,
    REPO_ROOT,
)
from launcher.processes import STOP_GRACE_SECONDS
from launcher.rundir import RUN_DIR_ENV
from launcher.serve import add_serve_parser


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    common = _common_options()
    # prog is left to argparse: "llm-suite" or "start_app.py", whichever was run.
    parser = argparse.ArgumentParser(
        description="Run the suite's apps (gateway, servers, chat UI) in the background, or "
        "serve one model with 'serve MODEL'.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_epilog(),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_deployment_commands(sub, common)
    _add_app_commands(sub, common)
    add_serve_parser(sub, common)
    return parser


def _common_options() -> argparse.ArgumentParser:
    """``--run-dir`` and ``--deployment``, which every command takes (a parent parser)."""
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
    return common


def _epilog() -> str:
    """The end of ``--help``: the apps, examples and the environment."""
    return "\n".join(
        [
            "apps (APP):",
            *(
                f"  {name:<10} {kind.module} (default port {kind.default_port})"
                for name, kind in APP_KINDS.items()
            ),
            "",
            "examples (llm-suite or python start_app.py):",
            "  llm-suite up          # every enabled app of configs/deployment.json",
            "  llm-suite status",
            "  llm-suite logs client -n 100 -f",
            "  llm-suite start sb_server --port 8012 --workers 2",
            "  llm-suite down",
            "  llm-suite serve models/SmolLM2-135M-Instruct --port 8000   # Ctrl-C stops it",
            "",
            f"environment: {RUN_DIR_ENV} sets the pid/log folder (default <repo>/run).",
            "Run '<command> --help' for the options of a command.",
        ]
    )


def _add_deployment_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """``up``, ``down`` and ``status``: the whole deployment at once."""
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


def _add_app_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """``start``, ``stop`` and ``logs``: one app."""
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
