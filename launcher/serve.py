"""``llm-suite serve MODEL``: one model behind a gateway, with no JSON to write.

It writes the two configs (a continuous-batching server for MODEL, a gateway in front of it)
into the run folder, starts both apps with the launcher (gunicorn, pid and log files, as ``up``
does) and then either returns (``--background``) or stays in the foreground like ``vllm serve``:
it prints both logs and stops both apps on Ctrl-C or SIGTERM. The CB server always binds
127.0.0.1 (it checks no keys); only the gateway listens where ``--host`` says.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

from launcher.console import StartAppError, err, say
from launcher.deployment import AppEntry, base_url
from launcher.processes import is_ours, pid_alive, stop_record
from launcher.rundir import AppRecord, read_record, resolve_run_dir
from launcher.serve_logs import LogFollower
from launcher.startup import bring_up, port_problem
from utils.config import resolve_path

#: The gateway's key reaches it through this variable, never through a JSON file.
API_KEY_ENV = "LLM_SUITE_API_KEY"
#: How many ports above the gateway's are tried for the CB server.
_PORT_SEARCH = 100


def add_serve_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register the ``serve`` command on the launcher's sub-command parser."""
    serve = sub.add_parser(
        "serve",
        parents=[common],
        help="serve one model: a continuous-batching server and a gateway, no config to write",
        description="Serve MODEL (a Hugging Face folder, a GGUF file or a GPTQ folder) through "
        "a continuous-batching server and a gateway in front of it. Runs in the foreground "
        "(Ctrl-C stops both) unless --background.",
    )
    serve.add_argument("model", nargs="?", metavar="MODEL", help="model folder or .gguf file")
    serve.add_argument("--host", default="127.0.0.1", help="gateway bind address (127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    serve.add_argument(
        "--server-port", type=int, help="CB server port (default: the next free one above --port)"
    )
    serve.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], help="torch dtype")
    serve.add_argument("--device", help="cpu (default) or cuda")
    serve.add_argument("--threads", type=int, help="torch threads of the CB server")
    serve.add_argument(
        "--quantization",
        choices=["int8", "int4", "gptq"],
        help="int8 / int4: quantise a dense MODEL at load (Q8_0 / Q4_1, CPU kernels); gptq: "
        "MODEL is a GPTQ folder (detected anyway)",
    )
    serve.add_argument("--served-model-name", help="model id clients use (default: from MODEL)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"key callers must send as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )
    serve.add_argument(
        "--config", help="a full CB server config JSON to start from (MODEL and flags override)"
    )
    serve.add_argument("--background", action="store_true", help="start, then return")
    serve.add_argument("--timeout", type=float, help="seconds to wait for each /health")
    serve.set_defaults(func=cmd_serve)


def server_config(args: argparse.Namespace) -> dict[str, Any]:
    """The CB server's config: ``--config`` (or the defaults), then MODEL and the flags."""
    config: dict[str, Any] = {}
    if args.config:
        try:
            config = json.loads(Path(args.config).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise StartAppError(f"cannot read --config {args.config}: {exc}") from None
    loading = config.setdefault("model_loading_config", {})
    for key in ("model_name_or_path", "tokenizer_name_or_path"):
        if args.config and isinstance(loading.get(key), str):
            # The config is rewritten into the run folder: its relative paths are made absolute
            # here, as the server would have resolved them beside the original file.
            loading[key] = os.path.abspath(resolve_path(args.config, loading[key]))
    if args.model:
        # Absolute: the server runs from another folder than the caller's.
        loading["model_name_or_path"] = os.path.abspath(os.path.expanduser(args.model))
    elif "model_name_or_path" not in loading:
        raise StartAppError("serve: give MODEL (a model folder or .gguf file) or --config")
    flags = {
        "torch_dtype": args.dtype,
        "device": args.device,
        "num_threads": args.threads,
        "quantize_method": args.quantization,
        "served_model_name": args.served_model_name,
    }
    loading.update({key: value for key, value in flags.items() if value is not None})
    return config


def gateway_config(server_url: str, with_key: bool) -> dict[str, Any]:
    """A gateway for one CB server; the key, if any, is read from ``$LLM_SUITE_API_KEY``."""
    return {
        "continuous_batching_server_urls": [server_url],
        "static_batching_server_urls": [],
        "openai_jumper_configs": [],
        "api_keys": [{"env": API_KEY_ENV}] if with_key else [],
        # A short heartbeat: the gateway sees its one server soon after both are up.
        "heart_beat_interval_seconds": 2,
    }


def _server_port(args: argparse.Namespace) -> int:
    if args.server_port:
        return int(args.server_port)
    for port in range(args.port + 1, min(args.port + _PORT_SEARCH, 65536)):
        if port_problem("127.0.0.1", port) is None:
            return port
    raise StartAppError(f"no free port between {args.port + 1} and {args.port + _PORT_SEARCH}")


def _check_server_config(path: Path) -> None:
    """Validate the written config before any process starts (errors name file and key)."""
    from server.continuous_batching.cb_server_config import load_cb_server_config
    from utils.config import ConfigError

    try:
        load_cb_server_config(path)
    except ConfigError as exc:
        raise StartAppError(f"cannot serve: {exc}") from None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def cmd_serve(args: argparse.Namespace) -> int:
    """``serve``: start a CB server and a gateway for MODEL; foreground unless --background."""
    run_dir = resolve_run_dir(args.run_dir, None)
    name = f"serve-{args.port}"
    for app in (f"{name}-gateway", f"{name}-server"):
        record = read_record(run_dir, app)
        if record and pid_alive(record.pid) and is_ours(record):
            raise StartAppError(f"{app} is already running (pid {record.pid}); stop it first")
    server_port = _server_port(args)
    configs = run_dir / name
    _write_json(configs / "cb_server.json", server_config(args))
    _check_server_config(configs / "cb_server.json")
    server_url = base_url("127.0.0.1", server_port)
    _write_json(configs / "gateway.json", gateway_config(server_url, bool(args.api_key)))
    secret_env = {API_KEY_ENV: args.api_key} if args.api_key else {}
    entries = [
        AppEntry(
            name=f"{name}-server",
            app="cb_server",
            config=str(configs / "cb_server.json"),
            port=server_port,
        ),
        AppEntry(
            name=f"{name}-gateway",
            app="client",
            config=str(configs / "gateway.json"),
            host=args.host,
            port=args.port,
            env=secret_env,
        ),
    ]
    code = bring_up(entries, run_dir, args.timeout)
    if code != 0:
        return code
    url = base_url(args.host, args.port)
    say(f"serving at {url}/v1 (OpenAI API), {url}/generate (native); logs in {run_dir}/logs")
    if args.background:
        say(f"stop with: llm-suite stop {name}-gateway && llm-suite stop {name}-server")
        return 0
    return _foreground(run_dir, [e.name for e in entries])


class _Stop(Exception):
    """Raised by the signal handler so that the foreground loop stops both apps."""


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def _foreground(run_dir: Path, names: list[str]) -> int:
    """Print the apps' logs until Ctrl-C, SIGTERM or an app's death; then stop both."""
    records = [r for r in (read_record(run_dir, n) for n in names) if r is not None]
    follower = LogFollower({r.name: Path(r.log_file) for r in records})
    # SIGINT explicitly too: a shell starts `llm-suite serve ... &` with SIGINT ignored, and
    # `kill -INT` must still stop both apps as Ctrl-C does in the foreground.
    previous = {s: signal.signal(s, _on_stop_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    say("press Ctrl-C to stop")
    code = 0
    try:
        while True:
            follower.pump()
            dead = [r.name for r in records if not pid_alive(r.pid)]
            if dead:
                err(f"{', '.join(dead)} exited; stopping the rest")
                code = 1
                break
            time.sleep(0.3)
    except (KeyboardInterrupt, _Stop):
        follower.pump()  # what the apps wrote since the last look, before saying "stopping"
        say()
        say("stopping:")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return _stop_all(records, run_dir) or code


def _stop_all(records: list[AppRecord], run_dir: Path) -> int:
    # The gateway first, so it sends nothing more to the server; Ctrl-C again is ignored here
    # since a half-stopped pair is worse than a few more seconds.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ok = all([stop_record(record, run_dir) for record in reversed(records)])
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0 if ok else 1
