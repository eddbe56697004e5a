"""The real deployment under gunicorn: start_app.py up -> a chat through the gateway -> down.

This is the demo's path (``make demo``) with the real default model, on free ports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from harness.network import free_port
from tests.launcher.start_app_runner import (
    live_processes_mentioning,
    run_start_app,
    write_deployment,
)
from tests.support.default_model import assert_answers_the_demo_question
from tests.support.paths import REPO_ROOT


def test_up_chat_status_down(tmp_path: Path, default_model_path: Path) -> None:
    cb_port, sb_port, gateway_port = free_port(), free_port(), free_port()
    sb_config = json.loads((REPO_ROOT / "configs" / "sb_server_config.json").read_text())
    sb_config["worker_config"]["model_name_or_path"] = str(default_model_path)
    (tmp_path / "sb.json").write_text(json.dumps(sb_config))
    cb_config = json.loads((REPO_ROOT / "configs" / "cb_server_config.json").read_text())
    cb_config["model_loading_config"]["model_name_or_path"] = str(default_model_path)
    cb_config["cache_config"]["memory_budget_gb"] = 0.25
    (tmp_path / "cb.json").write_text(json.dumps(cb_config))
    # The servers by app name: `up` tells the gateway its deployment file (which is not beside
    # the gateway's config here), and the ports live in that file only.
    client_config = {
        "continuous_batching_server_urls": ["cb_server"],
        "static_batching_server_urls": ["sb_server"],
    }
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "client.json").write_text(json.dumps(client_config))
    deployment = write_deployment(
        tmp_path / "deployment.json",
        [
            {
                "name": "cb_server",
                "app": "cb_server",
                "config": str(tmp_path / "cb.json"),
                "port": cb_port,
            },
            {
                "name": "sb_server",
                "app": "sb_server",
                "config": str(tmp_path / "sb.json"),
                "port": sb_port,
            },
            {
                "name": "client",
                "app": "client",
                "config": str(tmp_path / "gateway" / "client.json"),
                "port": gateway_port,
            },
        ],
    )
    run_dir = tmp_path / "run"
    try:
        up = run_start_app("up", "--deployment", str(deployment), run_dir=run_dir)
        assert up.returncode == 0, up.stdout + up.stderr

        status = run_start_app("status", "--deployment", str(deployment), run_dir=run_dir)
        assert status.returncode == 0, status.stderr
        assert "sb_server" in status.stdout and "client" in status.stdout

        assert_answers_the_demo_question(f"http://127.0.0.1:{gateway_port}")
        # Both servers are up; the gateway sends the model's traffic to the CB server.
        backends = httpx.get(f"http://127.0.0.1:{gateway_port}/backends", timeout=10).json()
        assert [b["is_healthy"] for b in backends["backends"]] == [True, True], backends
        cb_metrics = httpx.get(f"http://127.0.0.1:{cb_port}/metrics", timeout=10).text
        assert 'endpoint="/v1/chat/completions",outcome="200"} 1.0' in cb_metrics
        # The demo's question finds the gateway on its moved port through the deployment file,
        # and its closing hint names that file.
        demo = subprocess.run(
            [sys.executable, "-m", "tools.demo_chat", "--deployment", str(deployment)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert demo.returncode == 0, demo.stdout + demo.stderr
        assert "Paris" in demo.stdout and f"127.0.0.1:{gateway_port}" in demo.stdout
        assert f"start_app.py down --deployment {deployment}" in demo.stdout
    finally:
        down = run_start_app("down", "--deployment", str(deployment), run_dir=run_dir)
    assert down.returncode == 0, down.stdout + down.stderr
    assert live_processes_mentioning(str(tmp_path)) == []
