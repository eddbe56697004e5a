"""The CB server with the shipped (bfloat16) config on a CPU of each kind, as a user starts it.

An AVX2-only CPU is stood in for by capping everything to AVX2: ``LLM_SUITE_CPU_ISA=avx2``
(our kernels), ``ATEN_CPU_CAPABILITY=avx2`` (torch's dispatch) and ``ONEDNN_MAX_CPU_ISA=AVX2``
(oneDNN, whose bf16 weight packing then raises exactly as on the AMD EPYC without AVX-512
that used to kill this server at load). The server must start, say which path serves in
/health and /metrics, and answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from harness.servers import reserve_socket
from harness.waiting import wait_until
from server.continuous_batching import huge_pages
from server.continuous_batching.model.cpu_isa import KERNEL_WORDS
from tests.support.cpu_paths import runnable_levels
from tests.support.default_model import assert_answers_the_demo_question
from tests.support.paths import REPO_ROOT

#: The environment that makes this machine behave as a CPU of each level.
CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}


def _anon_huge_kb(pid: int) -> int:
    """Anonymous memory of process ``pid`` in transparent huge pages, kB."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("level", [lv for lv in ("avx2", "generic") if lv in runnable_levels()])
def test_shipped_config_starts_and_answers_on_a_lower_cpu(
    level: str, tmp_path: Path, default_model_path: Path
) -> None:
    config = json.loads((REPO_ROOT / "configs" / "cb_server_config.json").read_text())
    assert config["model_loading_config"]["torch_dtype"] == "bfloat16"  # the shipped default
    config["model_loading_config"]["model_name_or_path"] = str(default_model_path)
    config["cache_config"]["memory_budget_gb"] = 0.25
    config_path = tmp_path / "cb.json"
    config_path.write_text(json.dumps(config))
    with reserve_socket() as sock:
        port = sock.getsockname()[1]
    env = {**os.environ, "LLM_SUITE_CPU_ISA": level, **CAPS[level]}
    log = tmp_path / "server.log"
    command = [
        sys.executable,
        "continuous_batching_server_app.py",
        "--config",
        str(config_path),
        "--port",
        str(port),
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"

    def health() -> dict | None:
        if process.poll() is not None:
            raise AssertionError(f"the server exited ({process.returncode}):\n{log.read_text()}")
        return httpx.get(f"{url}/health", timeout=5).json()

    try:
        report = wait_until(
            health,
            120,
            interval=0.5,
            ignoring=(httpx.TransportError,),
            message=lambda: f"the server to start:\n{log.read_text()[-3000:]}",
        )
        compute = report["compute"]
        assert compute["device"] == "cpu" and compute["isa"] == level
        assert f"{KERNEL_WORDS[level]}, bf16 weights" in compute["summary"]
        # The level capped torch's own dispatch too (set before torch ran anything).
        torch_level = {"avx2": "AVX2", "generic": "DEFAULT"}[level]
        assert compute["summary"].endswith(f"torch's own CPU kernels: {torch_level}")
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert f'isa="{level}"' in metrics and "llm_compute_path_info{" in metrics
        assert_answers_the_demo_question(url)
        text = log.read_text()
        assert "CPU path: decoder ops:" in text
        # The weights and KV cache in 2 MB pages where the kernel allows (huge_pages).
        if huge_pages.system_mode() in ("always", "madvise") and huge_pages.ENV not in env:
            assert "huge pages for weights and KV cache: True" in text
            assert _anon_huge_kb(process.pid) > 0
        if level == "generic":  # bf16 with no fast matmul: served, with a warning of the cost
            assert "no fast matmul on this CPU path" in text
    finally:
        process.terminate()
        process.wait(30)
