"""A real Triton Inference Server (PyTriton) in a subprocess, for tests.

``stand_in/pytriton_server.py`` runs in its own Python 3.12 venv (``.venv-triton``: PyTriton
and numpy, no torch), built here on first use when missing (about 25 seconds and 355 MB: see
``stand_in/setup_venv.py``). Its model runs in a worker process under this interpreter
(the project's, with CPU torch and transformers) unless $LLM_SUITE_TRITON_WORKER_PYTHON names
another. The server listens on free 127.0.0.1 ports and is ready once Triton says its *model* is
ready: ``/v2/health/ready`` already answers 200 while the model is still loading.

Tests skip, saying why, only where no Python 3.12 exists; any other failure (the venv cannot be
built, the server dies or never gets ready) fails them, with the server's log tail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from harness.network import free_port
from harness.waiting import wait_until
from tests.support.paths import REPO_ROOT
from tests.triton.stand_in.pytriton_server import WORKER_PYTHON_ENV
from tests.triton.stand_in.setup_venv import TritonVenvError, ensure_venv, find_python312

SERVER_SCRIPT = Path(__file__).resolve().with_name("stand_in") / "pytriton_server.py"
#: TensorRT-LLM deployments call their model "ensemble"; the gateway maps our names onto it.
DEFAULT_TRITON_MODEL = "ensemble"


@dataclass
class TritonServer:
    """A running PyTriton server process (its own session, so its children die with it)."""

    process: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    metrics_port: int
    model_name: str
    log_path: Path

    @property
    def url(self) -> str:
        """The server's HTTP address."""
        return f"http://127.0.0.1:{self.http_port}"

    def model_url(self, endpoint: str = "") -> str:
        """``{url}/v2/models/{model}`` plus ``/endpoint`` when given."""
        base = f"{self.url}/v2/models/{self.model_name}"
        return f"{base}/{endpoint}" if endpoint else base

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log (tritonserver's and the script's)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout_seconds: float) -> None:
        """Wait until the model answers ready; raise with the log tail if it never does."""
        with httpx.Client(timeout=2) as client:

            def model_ready() -> bool:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"Triton server exited with {self.process.returncode}:\n{self.log_tail()}"
                    )
                return client.get(self.model_url("ready")).status_code == 200

            wait_until(
                model_ready,
                timeout_seconds,
                interval=0.5,
                ignoring=(httpx.TransportError,),  # not listening yet
                message=lambda: f"the Triton model to be ready; log tail:\n{self.log_tail()}",
            )

    def worker_pid(self) -> int | None:
        """The process id of the server's model worker (its child), or None when it has none."""
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(
                    line.split(":\t", 1)
                    for line in status.read_text().splitlines()
                    if ":\t" in line
                )
                if int(fields["PPid"]) != self.process.pid:
                    continue
                cmdline = (status.parent / "cmdline").read_bytes()
            except (OSError, KeyError, ValueError):
                continue  # gone meanwhile, or not ours to read
            if b"transformers_worker.py" in cmdline:
                return int(status.parent.name)
        return None

    def stop(self, grace_seconds: float = 15.0) -> None:
        """SIGTERM the process group (PyTriton, model worker, tritonserver, stubs), then KILL."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            # Triton waits for in-flight requests; a stuck one must not hang the test run.
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        except ProcessLookupError:
            pass


def start_triton_server(
    model_dir: Path,
    work_dir: Path,
    *,
    model_name: str = DEFAULT_TRITON_MODEL,
    chat_template: bool = False,
    ready_timeout_seconds: float = 180.0,
) -> TritonServer:
    """Start the PyTriton server over ``model_dir`` and wait until its model is ready.

    Calls ``pytest.skip`` when no Python 3.12 exists; builds ``.venv-triton`` when missing.
    ``work_dir`` receives the log and PyTriton's workspace.
    """
    if find_python312() is None:
        pytest.skip("no Python 3.12 on this machine: PyTriton's backend stub needs it")
    try:
        python = ensure_venv()
    except TritonVenvError as exc:
        pytest.fail(f"cannot build the Triton venv: {exc}")
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / "pytriton_server.log"
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    command = [
        str(python),
        str(SERVER_SCRIPT),
        "--model-dir",
        str(model_dir),
        "--model-name",
        model_name,
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        "--workspace",
        str(work_dir / "workspace"),
    ]
    if chat_template:
        command.append("--chat-template")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # The 3.11 project venv's paths must not leak into the 3.12 interpreter.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    # The model worker runs under the interpreter running the tests: it has torch and
    # transformers (the server's own default, the repository's .venv, may not exist).
    env.setdefault(WORKER_PYTHON_ENV, sys.executable)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO_ROOT,
            env=env,
            start_new_session=True,
        )
    server = TritonServer(process, http_port, grpc_port, metrics_port, model_name, log_path)
    try:
        server.wait_ready(ready_timeout_seconds)
    except BaseException:
        server.stop(grace_seconds=5)
        raise
    return server
