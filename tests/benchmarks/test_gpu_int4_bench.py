"""benchmarks/bench_int4_gpu.py off a GPU: a tiny act-order run in Triton's interpreter, as a
script from the checkout, writes one row per layer and batch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

# Not imported here: importing triton decides once whether kernels are interpreted, and the
# engine tests collected after this module set TRITON_INTERPRET=1 before they import it.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_tiny_interpreted_run(tmp_path: Path) -> None:
    out = tmp_path / "int4.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "bench_int4_gpu.py"),
        *("--device", "cpu", "--shapes", "tiny", "--rows", "1", "3", "--group-size", "32"),
        *("--act-order", "--dtype", "float32", "--iters", "1", "--out", str(out)),
    ]
    done = subprocess.run(
        command, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["layer"], r["rows"]) for r in rows] == [
        ("qkv", 1),
        ("qkv", 3),
        ("down", 1),
        ("down", 3),
    ]
    assert all(r["int4_us"] > 0 and r["dense_us"] > 0 for r in rows)
