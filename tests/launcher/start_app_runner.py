"""Running ``start_app.py`` from tests and checking what it leaves behind (Linux ``/proc``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.paths import REPO_ROOT

START_APP = REPO_ROOT / "start_app.py"


def is_alive(pid: int) -> bool:
    """os.kill(pid, 0), except that zombies count as dead.

    Masters re-parented to an init that never reaps (as in some containers) stay zombies
    after they exit; they hold no port and run no code.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not Path("/proc/self/stat").exists()
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def live_processes_mentioning(token: str) -> list[int]:
    """Pids of live processes whose command line contains ``token`` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if token in cmdline and is_alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def run_start_app(
    *args: str, run_dir: Path, timeout: float = 180.0
) -> subprocess.CompletedProcess[str]:
    """Run ``python start_app.py ARGS`` with LLM_SUITE_RUN_DIR=run_dir."""
    env = dict(os.environ, **{"LLM_SUITE_RUN_DIR": str(run_dir), "HF_HUB_OFFLINE": "1"})
    command = [sys.executable, str(START_APP), *args]
    output = {"capture_output": True, "text": True, "stdin": subprocess.DEVNULL}
    return subprocess.run(command, cwd=REPO_ROOT, env=env, timeout=timeout, **output)


def write_deployment(path: Path, apps: list[dict[str, Any]], **extra: Any) -> Path:
    """Write a deployment file with ``apps`` entries; return its path."""
    path.write_text(json.dumps({"run_dir": None, "apps": apps, **extra}, indent=2))
    return path
