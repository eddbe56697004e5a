"""tools/prepare_model.py as a user runs it: its lock leaves no file behind, still excludes
concurrent holders, and Ctrl-C ends a run with a line, not a traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

from harness.waiting import wait_until
from tests.support.paths import REPO_ROOT
from tools import prepare_model


def test_the_lock_excludes_holders_and_leaves_no_file(tmp_path: Path) -> None:
    output = tmp_path / "model"
    num_inside, overlaps = [0], []

    def hold() -> None:
        for _ in range(20):
            with prepare_model._exclusive_lock(output):
                num_inside[0] += 1
                overlaps.append(num_inside[0] > 1)
                num_inside[0] -= 1

    threads = [threading.Thread(target=hold) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(overlaps) == 80 and not any(overlaps)
    assert not list(tmp_path.glob(".*.lock"))


def test_ctrl_c_ends_with_a_line_and_no_lock(tmp_path: Path) -> None:
    output = tmp_path / "model"
    process = subprocess.Popen(
        [sys.executable, "-m", "tools.prepare_model", "--output", str(output), "--force"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    lines: list[str] = []
    # Interrupt once it is at work (its first step line), as a user pressing Ctrl-C would.
    wait_until(lambda: lines.append(process.stdout.readline()) or "..." in lines[-1], 60)
    process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=60)
    text = "".join(lines) + out
    assert process.returncode == 130, text
    assert "interrupted" in text and "Traceback" not in text
    assert not output.exists() and not list(tmp_path.glob(".*.lock"))
