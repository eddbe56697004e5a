"""start_app.py with real processes: gunicorn masters and uvicorn workers on loopback ports.

The suite's real apps are exercised elsewhere; here each deployment entry points, through the
``module`` and ``pythonpath`` fields, at a tiny stand-in ASGI module written into tmp_path, so
these tests need no model and take a few seconds each. The helpers (``start_app_runner.py``
beside this file) work the same for a deployment of real apps (``test_deployment.py``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.network import free_port
from tests.launcher.start_app_runner import (
    START_APP,
    is_alive,
    live_processes_mentioning,
    run_start_app,
    write_deployment,
)

STANDIN_MODULE = '''
"""Stand-in for the suite's apps: build_app(config_path) -> FastAPI app with GET /health."""
import json

from fastapi import FastAPI


def build_app(config_path=None):
    config = {}
    if config_path:
        with open(config_path) as handle:
            config = json.load(handle)
    if config.get("fail"):
        raise RuntimeError("stand-in failure: build_app was told to fail")
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "ok", "name": config.get("name")}

    return app
'''


@pytest.fixture
def workspace(tmp_path: Path) -> Iterator[Path]:
    """tmp_path with the stand-in module and a run folder; tears down whatever is left."""
    (tmp_path / "standin_app.py").write_text(STANDIN_MODULE)
    (tmp_path / "run").mkdir()
    yield tmp_path
    # Safety net for failing tests: never leave servers behind.
    run_start_app("down", run_dir=tmp_path / "run", timeout=60)
    for pid in live_processes_mentioning(str(tmp_path)):
        os.kill(pid, 9)


def standin_entry(ws: Path, name: str, port: int, **config: Any) -> dict[str, Any]:
    """A deployment entry running the stand-in module with its own config file."""
    config_file = ws / f"{name}_config.json"
    config_file.write_text(json.dumps({"name": name, **config}))
    return {
        "name": name,
        "module": "standin_app",
        "pythonpath": [str(ws)],
        "config": str(config_file),
        "host": "127.0.0.1",
        "port": port,
        "workers": 1,
        "enabled": True,
    }


def output_of(result: subprocess.CompletedProcess[str]) -> str:
    """stdout and stderr together, for assertions and failure messages."""
    return result.stdout + result.stderr


def test_help_lists_commands() -> None:
    result = subprocess.run(
        [sys.executable, str(START_APP), "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    for command in ("up", "down", "status", "start", "stop", "logs"):
        assert command in result.stdout


def test_up_status_down_leaves_nothing_behind(workspace: Path) -> None:
    run_dir = workspace / "run"
    ports = [free_port(), free_port()]
    deployment = write_deployment(
        workspace / "deployment.json",
        [
            standin_entry(workspace, "alpha", ports[0]),
            {**standin_entry(workspace, "disabled", free_port()), "enabled": False},
            standin_entry(workspace, "beta", ports[1]),
        ],
    )

    up = run_start_app("up", "--deployment", str(deployment), "--timeout", "90", run_dir=run_dir)
    assert up.returncode == 0, output_of(up)
    assert "all up" in up.stdout

    status = run_start_app("status", "--json", "--deployment", str(deployment), run_dir=run_dir)
    assert status.returncode == 0, output_of(status)
    rows = {row["name"]: row for row in json.loads(status.stdout)}
    assert set(rows) == {"alpha", "beta"}  # the disabled entry is neither started nor listed
    for name, port in zip(("alpha", "beta"), ports, strict=True):
        assert rows[name]["alive"] is True
        assert rows[name]["health_status"] == 200
        assert rows[name]["url"] == f"http://127.0.0.1:{port}"
        answer = httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False).json()
        assert answer["name"] == name
    pids = [rows["alpha"]["pid"], rows["beta"]["pid"]]
    assert (run_dir / "alpha.pid").read_text().strip() == str(pids[0])
    assert (run_dir / "logs" / "alpha.log").exists()
    workers = live_processes_mentioning(str(workspace))
    assert len(workers) >= 4, workers  # two masters and at least one worker each

    table = run_start_app("status", run_dir=run_dir)
    assert "alpha" in table.stdout and "200" in table.stdout

    # A second `up` leaves the running apps alone.
    again = run_start_app("up", "--deployment", str(deployment), run_dir=run_dir)
    assert again.returncode == 0, output_of(again)
    assert "already running" in again.stdout

    down = run_start_app("down", run_dir=run_dir)
    assert down.returncode == 0, output_of(down)
    for pid in pids + workers:
        assert not is_alive(pid), f"pid {pid} survived `down`"
    assert live_processes_mentioning(str(workspace)) == []
    assert not list(run_dir.glob("*.json")) and not list(run_dir.glob("*.pid"))

    after = run_start_app("status", "--json", "--deployment", str(deployment), run_dir=run_dir)
    assert [(r["name"], r["alive"]) for r in json.loads(after.stdout)] == [
        ("alpha", False),
        ("beta", False),
    ]
    assert run_start_app("down", run_dir=run_dir).returncode == 0  # idempotent


def test_taken_port_fails_fast_naming_app_and_port(workspace: Path) -> None:
    run_dir = workspace / "run"
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        deployment = write_deployment(
            workspace / "deployment.json",
            [
                standin_entry(workspace, "first", free_port()),
                standin_entry(workspace, "squatted", taken),
            ],
        )
        start = time.monotonic()
        result = run_start_app("up", "--deployment", str(deployment), run_dir=run_dir)
        elapsed = time.monotonic() - start
    assert result.returncode == 1, output_of(result)
    assert "squatted" in result.stderr and str(taken) in result.stderr
    assert "nothing was started" in result.stderr
    assert elapsed < 15, f"took {elapsed:.1f} s"
    assert live_processes_mentioning(str(workspace)) == []
    assert not list(run_dir.glob("*.json"))


def test_failing_app_shows_log_tail_and_stops_the_others(workspace: Path) -> None:
    run_dir = workspace / "run"
    deployment = write_deployment(
        workspace / "deployment.json",
        [
            standin_entry(workspace, "healthy", free_port()),
            standin_entry(workspace, "broken", free_port(), fail=True),
        ],
    )
    result = run_start_app(
        "up", "--deployment", str(deployment), "--timeout", "90", run_dir=run_dir
    )
    out = output_of(result)
    assert result.returncode == 1, out
    assert "'broken'" in result.stderr
    assert "stand-in failure: build_app was told to fail" in result.stderr  # from the log tail
    assert "healthy: stopped" in result.stdout  # the app started before it was stopped again
    assert live_processes_mentioning(str(workspace)) == []
    assert not list(run_dir.glob("*.json"))


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["apps"][1].update(prot=1), "apps[1].prot: Extra inputs are not permitted"),
        (lambda d: d["apps"][0].update(port="eighty"), "apps[0].port"),
        (lambda d: d["apps"][0].pop("port"), "apps[0].port: Field required"),
        (lambda d: d["apps"][0].update(app="nope"), "apps[0].app"),
        (lambda d: d.update(extra_key=True), "extra_key: Extra inputs are not permitted"),
        (lambda d: d["apps"][1].update(name="alpha"), "repeated: alpha"),
        (lambda d: d["apps"][1].update(app="chat_ui", config="x.json"), "takes no config file"),
    ],
)
def test_bad_deployment_names_file_and_key(tmp_path: Path, mutate: Any, expected: str) -> None:
    data: dict[str, Any] = {
        "run_dir": None,
        "apps": [
            {"name": "alpha", "app": "sb_server", "port": 18002},
            {"name": "beta", "app": "client", "port": 18000},
        ],
    }
    mutate(data)
    path = tmp_path / "bad_deployment.json"
    path.write_text(json.dumps(data))
    result = run_start_app("up", "--deployment", str(path), run_dir=tmp_path / "run")
    assert result.returncode == 1
    assert str(path) in result.stderr
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_invalid_json_deployment(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"apps": [}')
    result = run_start_app("up", "--deployment", str(path), run_dir=tmp_path / "run")
    assert result.returncode == 1
    assert str(path) in result.stderr and "line 1" in result.stderr


def test_start_logs_stop_one_app(workspace: Path) -> None:
    run_dir = workspace / "run"
    deployment = write_deployment(
        workspace / "deployment.json", [standin_entry(workspace, "other", free_port())]
    )
    port = free_port()
    config = workspace / "solo_config.json"
    config.write_text(json.dumps({"name": "solo"}))
    common = ["--deployment", str(deployment)]
    started = run_start_app(
        "start", "solo", *common, "--module", "standin_app", "--pythonpath", str(workspace),
        "--config", str(config), "--port", str(port), "--timeout", "90",
        run_dir=run_dir,
    )  # fmt: skip
    assert started.returncode == 0, output_of(started)
    record = json.loads((run_dir / "solo.json").read_text())
    assert httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False).json()["name"] == "solo"

    logs = run_start_app("logs", "solo", "-n", "5", *common, run_dir=run_dir)
    assert logs.returncode == 0, output_of(logs)
    assert 0 < len(logs.stdout.splitlines()) <= 5

    missing = run_start_app("stop", "nobody", *common, run_dir=run_dir)
    assert missing.returncode == 1 and "solo" in missing.stderr  # lists what is recorded

    stopped = run_start_app("stop", "solo", *common, run_dir=run_dir)
    assert stopped.returncode == 0, output_of(stopped)
    assert not is_alive(record["pid"])
    assert live_processes_mentioning(str(workspace)) == []


def test_chat_ui_runs_under_streamlit(workspace: Path) -> None:
    """The chat UI entry: streamlit in the background, healthy, in status, stopped by down."""
    pytest.importorskip("streamlit", reason="the chat UI needs the 'ui' extra")
    run_dir = workspace / "run"
    port = free_port()
    deployment = write_deployment(
        workspace / "deployment.json",
        [
            {
                "name": "chat_ui",
                "app": "chat_ui",
                "port": port,
                # No gateway needed to serve the page; this one is never called here.
                "env": {"LLM_SUITE_GATEWAY_URL": "http://127.0.0.1:9"},
            }
        ],
    )
    up = run_start_app("up", "--deployment", str(deployment), "--timeout", "90", run_dir=run_dir)
    try:
        assert up.returncode == 0, output_of(up)
        record = json.loads((run_dir / "chat_ui.json").read_text())
        assert record["command"][1:4] == ["-m", "streamlit", "run"]
        assert record["health_path"] == "/_stcore/health"
        assert (run_dir / "chat_ui.pid").read_text().strip() == str(record["pid"])
        page = httpx.get(f"http://127.0.0.1:{port}/", trust_env=False, timeout=10)
        assert page.status_code == 200 and "<html" in page.text.lower()

        status = run_start_app("status", "--json", "--deployment", str(deployment), run_dir=run_dir)
        [row] = json.loads(status.stdout)
        assert (row["name"], row["alive"], row["health_status"]) == ("chat_ui", True, 200)
    finally:
        down = run_start_app("down", run_dir=run_dir)
    assert down.returncode == 0, output_of(down)
    assert "chat_ui: stopped" in down.stdout
    assert not is_alive(record["pid"])
    assert not list(run_dir.glob("*.json")) and not list(run_dir.glob("*.pid"))


def test_shipped_deployment_points_the_chat_ui_at_its_gateway() -> None:
    """configs/deployment.json is valid, and its chat UI talks to its gateway, started before."""
    import start_app  # the module under test, imported here: the other tests run it as a script

    deployment = start_app.load_deployment(start_app.DEFAULT_DEPLOYMENT)
    entries = {entry.app: entry for entry in deployment.apps}
    ui, gateway = entries["chat_ui"], entries["client"]
    # The gateway named by its app: its port is written once, in the deployment file.
    assert ui.env["LLM_SUITE_GATEWAY_URL"] == gateway.name
    from chat_ui.gateway_client import gateway_url_from

    deployment_file = str(start_app.DEFAULT_DEPLOYMENT)
    environ = {"LLM_SUITE_GATEWAY_URL": "client", "LLM_SUITE_DEPLOYMENT_FILE": deployment_file}
    url = gateway_url_from([], environ)
    assert url == start_app.base_url(gateway.host, gateway.port)
    assert ui.launcher == "streamlit" and ui.health_path == "/_stcore/health"
    order = sorted(deployment.apps, key=lambda e: start_app.ROLE_ORDER[e.role])
    assert [e.app for e in order][-2:] == ["client", "chat_ui"]
