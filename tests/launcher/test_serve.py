"""``llm-suite serve MODEL``: a real CB server and gateway as processes, the ``openai`` SDK through
them, Ctrl-C (SIGINT) and nothing left; plus the refusals that start nothing."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from harness.network import free_port
from harness.waiting import wait_until
from launcher.serve import server_config
from launcher.serve_logs import LogFollower
from tests.launcher.start_app_runner import is_alive
from tests.support.default_model import DEMO_QUESTION, MODEL_ID
from tests.support.paths import REPO_ROOT

SERVE = [sys.executable, "-m", "launcher", "serve"]


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240
    )


def _pids(run_dir: Path) -> dict[str, int]:
    return {p.stem: json.loads(p.read_text())["pid"] for p in run_dir.glob("*.json")}


@pytest.mark.slow
def test_serve_answers_the_openai_sdk_and_ctrl_c_stops_both(
    tmp_path: Path, default_model_path: Path
) -> None:
    port, run_dir, out = free_port(), tmp_path / "run", tmp_path / "serve.out"
    secret = "sk-serve-test-0123456789"
    env = dict(os.environ, HF_HUB_OFFLINE="1", LLM_SUITE_API_KEY=secret)
    command = [*SERVE, str(default_model_path), "--port", str(port), "--run-dir", str(run_dir)]
    with open(out, "wb") as log:
        # Started as a shell starts `llm-suite serve ... &`: with SIGINT ignored. Ctrl-C in a
        # terminal and `kill -INT` of such a job must both stop it.
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=log,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
    try:
        wait_until(
            lambda: "press Ctrl-C" in out.read_text() or process.poll() is not None,
            240,
            message="llm-suite serve to come up",
        )
        assert process.poll() is None, out.read_text()
        pids = _pids(run_dir)
        assert set(pids) == {f"serve-{port}-server", f"serve-{port}-gateway"}, pids

        base_url = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=base_url, api_key=secret, max_retries=0)
        answer = client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": DEMO_QUESTION}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in (answer.choices[0].message.content or "")

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0, out.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = out.read_text()
    assert "POST /v1/chat/completions" in text  # the apps' logs were shown as they came
    assert "GET /health HTTP" not in text  # but not the probes
    for name, pid in pids.items():
        assert not is_alive(pid), f"{name} (pid {pid}) still runs"
    assert not list(run_dir.glob("*.json")), "records left behind"
    # The key reached the gateway through its environment: no file or log line holds it.
    for path in [out, *run_dir.rglob("*")]:
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), path


@pytest.mark.slow
def test_serve_in_the_background_is_stopped_by_down(
    tmp_path: Path, default_model_path: Path
) -> None:
    port, run_dir = free_port(), tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("LLM_SUITE_API_KEY", None)
    command = [*SERVE, str(default_model_path), "--port", str(port), "--run-dir", str(run_dir)]
    launcher = [sys.executable, "-m", "launcher"]
    pids: dict[str, int] = {}
    try:
        done = _run(
            [*command, "--background", "--served-model-name", "smol", "--threads", "1"], env
        )
        assert done.returncode == 0, done.stdout + done.stderr
        pids = _pids(run_dir)
        assert all(is_alive(pid) for pid in pids.values()) and len(pids) == 2, pids
        models = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-").models.list()
        assert [model.id for model in models] == ["smol"]
        status = _run([*launcher, "status", "--run-dir", str(run_dir)], env)
        assert f"serve-{port}-gateway" in status.stdout and f"serve-{port}-server" in status.stdout
    finally:
        down = _run([*launcher, "down", "--run-dir", str(run_dir)], env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(is_alive(pid) for pid in pids.values())
    assert not list(run_dir.glob("*.json"))


def test_serve_a_missing_model_starts_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    command = [*SERVE, str(missing), "--port", str(free_port()), "--run-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert str(missing) in done.stderr and "config.json missing" in done.stderr, done.stderr
    assert not list(tmp_path.glob("*.json"))


def test_serve_needs_a_model(tmp_path: Path) -> None:
    command = [*SERVE, "--run-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "give MODEL" in done.stderr, done.stderr


def test_log_follower_prefixes_lines_and_hides_probes(tmp_path: Path) -> None:
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_text('x - "GET /health HTTP/1.1" 200\nstarted\npart')
    second.write_text("")
    out = io.StringIO()
    follower = LogFollower({"gateway": first, "server": second}, out=out)
    follower.pump()
    with open(first, "a") as handle:
        handle.write("ial line\n")
    follower.pump()
    assert out.getvalue().splitlines() == ["gateway | started", "gateway | partial line"]


def test_a_full_config_keeps_its_relative_paths_and_flags_override_it(tmp_path: Path) -> None:
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "cb.json"
    loading = {"model_name_or_path": "models/m", "torch_dtype": "float32", "num_threads": 4}
    config.write_text(json.dumps({"model_loading_config": loading, "cache_config": {"x": 1}}))
    args = argparse.Namespace(
        config=str(config), model=None, dtype="bfloat16", device=None, threads=None,
        served_model_name=None, quantization="int4",
    )  # fmt: skip
    written = server_config(args)
    assert written["model_loading_config"] == {
        "model_name_or_path": str(tmp_path / "models" / "m"),  # beside the config's folder
        "torch_dtype": "bfloat16",
        "num_threads": 4,
        "quantize_method": "int4",  # --quantization
    }
    assert written["cache_config"] == {"x": 1}
