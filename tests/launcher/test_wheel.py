"""The wheel: it installs the ``llm-suite`` command and carries the shipped configs and the
fused CPU kernels' sources."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT


@pytest.mark.slow
def test_wheel_has_the_console_script_and_the_configs(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path)],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=240,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("llm_serving_suite-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()
    assert "[console_scripts]" in scripts
    assert "llm-suite = launcher.cli:main" in scripts
    shipped = {p.name for p in (REPO_ROOT / "configs").glob("*.json")}
    assert shipped and {f"configs/{name}" for name in shipped} <= names
    assert "launcher/serve.py" in names and "launcher/__main__.py" in names
    assert "chat_ui_app.py" in names  # the launcher runs it by path under streamlit
    # The fused CPU kernels compile from these on the machine that runs them: every header too.
    from server.continuous_batching.model import cpu_kernels

    kernels = "server/continuous_batching/model/cpu_kernels"
    sources = {f"{kernels}/{p.name}" for p in cpu_kernels.SOURCES}
    assert {f"{kernels}/cpu_kernels.cpp", f"{kernels}/simd.h"} <= sources <= names
