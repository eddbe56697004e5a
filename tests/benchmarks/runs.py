"""Running a benchmark as its users do: ``python -m benchmarks.X`` from the repository root,
in a bare environment (no ``PYTHONPATH``: the working directory alone makes the project
importable, and no benchmark patches ``sys.path``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REPO_ROOT

#: Skips a module whose benchmark runs Triton kernels (in the interpreter off a GPU). Triton is
#: not imported here: importing it decides once whether kernels are interpreted, and the engine
#: tests collected after such a module set TRITON_INTERPRET=1 before they import it.
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


def run_benchmark(module: str, *args: str, timeout: float = 300) -> None:
    """Run ``benchmarks.<module>`` with ``args``; fails with the end of its stderr."""
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=REPO_ROOT,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def results_of(path: Path) -> list[dict[str, Any]]:
    """The result rows a benchmark wrote to ``path``."""
    return json.loads(path.read_text())["results"]
