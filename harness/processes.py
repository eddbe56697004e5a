"""Deployments of real processes: model servers, gateways and fakes, over real sockets.

A :class:`Deployment` owns the processes of one run. Each is a Python program started from the
repository root (the checkout under test: ``PYTHONPATH`` or the working directory decides what
it imports), with its config file and its log in the deployment's folder; :meth:`Deployment.stop`
ends them all. The benchmarks (failover, resume under fire, replicas under chaos) and the tests
that run them with smaller loads deploy through it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from harness.network import free_port
from harness.waiting import async_wait_until, wait_until
from tools.prepare_model import default_model_dir

#: The repository root: every process starts there.
REPO_ROOT = Path(__file__).resolve().parents[1]
#: Longest wait for a process to become ready (a CB server loads the model first).
START_TIMEOUT_SECONDS = 180.0

#: Completion prompts of the resume runs (benchmark and multi-host test): open-ended, so that
#: a stream with ``ignore_eos`` runs its whole budget with text worth comparing.
RESUME_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
    "def fibonacci(n):",
    "In 1969, humans",
    "Rain is",
    "My favourite food is",
    "The quick brown fox",
]

#: A gateway's settings in a deployment: failures noticed within a second or two.
GATEWAY_DEFAULTS: dict[str, Any] = {
    "num_failures_to_mark_down": 2,
    "health_timeout_seconds": 1,
    "connect_timeout_seconds": 1,
    "request_timeout_seconds": 60,
}


def tail(path: Path, num_chars: int = 3000) -> str:
    """The end of a log file (or a note that there is none)."""
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else "(no log)"


def cb_server_config(model_dir: Path, dtype: str, num_threads: int = 1) -> dict[str, Any]:
    """A CB server's config for a deployment of several processes on a small machine: the
    model's threads pinned, a small cache (0.25 GB, 64 CPU blocks)."""
    return {
        "model_loading_config": {
            "model_name_or_path": str(model_dir),
            "torch_dtype": dtype,
            "num_threads": num_threads,
        },
        "cache_config": {"memory_budget_gb": 0.25, "num_blocks_cpu": 64},
    }


def gateway_client(base_url: str, log: Path, name: str, timeout: float = 30) -> httpx.Client:
    """A client of the gateway process at ``base_url``, once it answers ``/health`` (a
    timeout names the gateway and shows the end of its ``log``)."""
    http = httpx.Client(base_url=base_url, timeout=10, trust_env=False)
    wait_until(
        lambda: http.get("/health").status_code == 200,
        timeout,
        interval=0.1,
        ignoring=(httpx.HTTPError,),
        message=lambda: f"gateway {name}: {tail(log, 2000)}",
    )
    return http


class Deployment:
    """Processes in one folder (configs, logs), stopped together.

    ``num_servers`` CB servers with the default model (ports chosen now, started by
    :meth:`start_server`) and one gateway port are planned; any other process is started
    with :meth:`spawn` under a name of its own.
    """

    def __init__(
        self,
        folder: Path,
        heartbeat_interval: float = 1.0,
        num_threads: int = 1,
        num_servers: int = 2,
        dtype: str = "bfloat16",
    ) -> None:
        self.folder = folder
        self.heartbeat_interval = heartbeat_interval
        self.num_threads = num_threads
        self.dtype = dtype
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        #: Names SIGKILLed on purpose: their exit is no failure (see :meth:`check_alive`).
        self.killed: set[str] = set()
        self.server_ports = [free_port() for _ in range(num_servers)]
        self.gateway_port = free_port()

    # addresses and files

    @property
    def gateway_url(self) -> str:
        """The gateway's address."""
        return f"http://127.0.0.1:{self.gateway_port}"

    def server_url(self, index: int) -> str:
        """The address of server ``index``."""
        return f"http://127.0.0.1:{self.server_ports[index]}"

    def log_path(self, name: str) -> Path:
        """Where process ``name`` logs."""
        return self.folder / f"{name}.log"

    def log_text(self, name: str) -> str:
        """Everything process ``name`` logged so far."""
        return self.log_path(name).read_text(errors="replace")

    def write_config(self, name: str, config: dict[str, Any]) -> Path:
        """Write ``config`` as ``<name>.json`` in the folder; returns its path."""
        path = self.folder / f"{name}.json"
        path.write_text(json.dumps(config))
        return path

    # processes

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        """Start ``python <args>`` from the repository root as process ``name`` (again, after a
        kill), its output appended to ``<name>.log``."""
        with self.log_path(name).open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, *args], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
            )
        self.processes[name] = process
        self.killed.discard(name)
        return process

    def start_server(self, index: int) -> None:
        """Start CB server ``index`` (again, after a kill) as process ``cb_<index>``."""
        config = cb_server_config(default_model_dir(), self.dtype, self.num_threads)
        path = self.write_config(f"cb_{index}", config)
        args = ["continuous_batching_server_app.py", "--config", str(path)]
        self.spawn(f"cb_{index}", [*args, "--port", str(self.server_ports[index])])

    def start_gateway(
        self,
        config: dict[str, Any] | None = None,
        name: str = "gateway",
        port: int | None = None,
        log_level: str | None = "warning",
    ) -> None:
        """Start a gateway as process ``name`` on ``port`` (default the planned gateway port).

        ``config`` None: over every planned server, with :data:`GATEWAY_DEFAULTS` and the
        deployment's heartbeat.
        """
        if config is None:
            config = {
                "continuous_batching_server_urls": [
                    self.server_url(i) for i in range(len(self.server_ports))
                ],
                "heart_beat_interval_seconds": self.heartbeat_interval,
                **GATEWAY_DEFAULTS,
            }
        args = ["client_app.py", "--config", str(self.write_config(name, config))]
        args += ["--port", str(port or self.gateway_port)]
        self.spawn(name, args + (["--log-level", log_level] if log_level else []))

    def kill(self, name: str) -> None:
        """SIGKILL process ``name``: no clean-up, connections reset, like a crash."""
        process = self.processes[name]
        self.killed.add(name)
        process.send_signal(signal.SIGKILL)
        process.wait(10)

    def stop(self, timeout: float = 15) -> None:
        """Terminate every process (SIGKILL those that do not exit in time)."""
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)

    def check_alive(self, *names: str) -> None:
        """Raise with the log's tail if process ``names`` (default: all) exited, unless it was
        killed on purpose."""
        for name in names or tuple(self.processes):
            process = self.processes[name]
            if process.poll() is not None and name not in self.killed:
                raise RuntimeError(
                    f"{name} exited with code {process.returncode}:\n{tail(self.log_path(name))}"
                )

    # waiting

    async def wait_backends(
        self,
        client: httpx.AsyncClient,
        predicate: Callable[[list[dict[str, Any]]], object],
        what: str,
        timeout: float = START_TIMEOUT_SECONDS,
    ) -> float:
        """Poll the gateway's ``/backends`` until ``predicate(rows)``; returns the seconds it
        took (every process must stay alive meanwhile)."""

        async def holds() -> bool:
            response = await client.get(f"{self.gateway_url}/backends", timeout=5)
            return response.status_code == 200 and bool(predicate(response.json()["backends"]))

        start = time.monotonic()
        await async_wait_until(
            holds,
            timeout,
            interval=0.05,
            message=what,
            ignoring=(httpx.HTTPError,),
            alive=self.check_alive,
        )
        return time.monotonic() - start

    async def start_all(self, client: httpx.AsyncClient) -> None:
        """Start every planned server and the gateway; wait until all are healthy."""
        num_servers = len(self.server_ports)
        for index in range(num_servers):
            self.start_server(index)
        self.start_gateway()
        await self.wait_backends(
            client,
            lambda rows: len(rows) == num_servers and all(row["is_healthy"] for row in rows),
            "the servers to be healthy",
        )
