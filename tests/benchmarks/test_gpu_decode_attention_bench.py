"""benchmarks/bench_decode_attention.py off a GPU: a tiny run in Triton's interpreter, as a
script from the checkout, writes one row per context with its bytes and bandwidth fraction."""

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
    out = tmp_path / "decode.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "bench_decode_attention.py"),
        *("--device", "cpu", "--batch", "2", "--contexts", "20", "40"),
        *("--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "float32"),
        *("--iters", "1", "--out", str(out)),
    ]
    done = subprocess.run(
        command, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["context"] for r in rows] == [20, 40]
    # K and V of 2 x 40 keys x 2 kv heads x 16 dims in float32, plus q, tables, lens, out.
    assert rows[1]["bytes"] == 2 * 2 * 40 * 2 * 16 * 4 + 2 * 2 * 4 * 16 * 4 + 2 * 3 * 4 + 2 * 4
    assert all(r["kernel_us"] > 0 and 0 < r["fraction_of_bandwidth"] for r in rows)
