"""Apps launched by start_app.py (gunicorn + our uvicorn worker) are served with the hardened
HTTP protocol: the connection limits the app sets hold, and framing errors answer in JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.network import free_port
from tests.launcher.start_app_runner import (
    live_processes_mentioning,
    run_start_app,
    write_deployment,
)
from tests.support.raw_http import assert_error_shape, connect, exchange, read_until_closed

#: A stand-in app that sets its connection limits as the suite's apps do.
STANDIN_MODULE = """
from fastapi import FastAPI

from utils.connection_limits import ConnectionLimits, set_limits


def build_app(config_path=None):
    app = FastAPI()
    set_limits(app, ConnectionLimits(header_timeout_seconds=1, keep_alive_timeout_seconds=0.5))

    @app.get("/health")
    def health():
        return {"status": "ok"}

    return app
"""


def test_gunicorn_workers_serve_with_the_hardened_protocol(tmp_path: Path) -> None:
    (tmp_path / "hardened_standin.py").write_text(STANDIN_MODULE)
    run_dir = tmp_path / "run"
    port = free_port()
    entry = {
        "name": "standin",
        "module": "hardened_standin",
        "pythonpath": [str(tmp_path)],
        "host": "127.0.0.1",
        "port": port,
        "workers": 1,
    }
    deployment = write_deployment(tmp_path / "deployment.json", [entry])
    try:
        started = run_start_app("up", "--deployment", str(deployment), run_dir=run_dir)
        assert started.returncode == 0, started.stdout + started.stderr
        url = f"http://127.0.0.1:{port}"
        bad = b"POST /health HTTP/1.1\r\nHost: t\r\nContent-Length: x\r\n\r\n"
        assert_error_shape(exchange(url, bad), 400)
        # The app's keep-alive (0.5 s), not gunicorn's --keep-alive (2 s).
        sock = connect(url)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = read_until_closed(sock, timeout_seconds=5)
        assert json.loads(answer.body) == {"status": "ok"}
        assert answer.seconds < 1.5, answer.seconds
        # The app's header timeout (1 s): a connection that says nothing is closed.
        assert read_until_closed(connect(url), timeout_seconds=5).seconds < 2.5
    finally:
        run_start_app("down", run_dir=run_dir, timeout=60)
        for pid in live_processes_mentioning(str(tmp_path)):
            os.kill(pid, 9)
