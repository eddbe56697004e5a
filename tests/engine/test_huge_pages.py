"""Huge pages for the CPU engine's weights (runner/huge_pages.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.continuous_batching.runner import huge_pages
from server.continuous_batching.runner.huge_pages import THP_ENV, huge_page_mib

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_requested_unless_the_user_decided(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv(THP_ENV, raising=False)
    assert huge_pages.request_huge_pages() is True
    monkeypatch.setenv(THP_ENV, "0")
    assert huge_pages.request_huge_pages() is False
    assert os.environ[THP_ENV] == "0"


def test_huge_page_mib_reads_smaps(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps_rollup"
    smaps.write_text("Rss:  1000 kB\nAnonHugePages:    63488 kB\n")
    assert huge_page_mib(smaps) == 62
    smaps.write_text("Rss:  1000 kB\n")
    assert huge_page_mib(smaps) is None
    assert huge_page_mib(tmp_path / "missing") is None


@pytest.mark.skipif(
    not _THP_MODE.exists() or "[never]" in _THP_MODE.read_text(),
    reason="this kernel has transparent huge pages off",
)
def test_a_fresh_process_puts_a_large_tensor_on_huge_pages() -> None:
    """What the runner relies on: the variable set after importing torch, before the first
    large allocation, takes effect (torch reads it then)."""
    code = (
        "import torch\n"
        "from server.continuous_batching.runner.huge_pages import huge_page_mib, "
        "request_huge_pages\n"
        "before = huge_page_mib()\n"
        "assert request_huge_pages()\n"
        "weights = torch.ones(64 << 20, dtype=torch.uint8)\n"
        "print(huge_page_mib() - before)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != THP_ENV}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) >= 32  # most of the 64 MiB tensor
