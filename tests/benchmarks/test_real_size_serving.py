"""The served real-size comparison's own logic, without its peers (CI has no vLLM venv and
does not build llama.cpp's server): the server runner's start, early-exit and stop; the pairing
of our rows with llama.cpp's on the same file and with vLLM's; the plot; the command line."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from benchmarks import real_size_serving
from benchmarks.vllm_peer import running_server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_running_server_waits_for_health_and_stops_the_group(tmp_path: Path) -> None:
    (tmp_path / "health").write_text("ok")
    port = _free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    cmd += ["--directory", str(tmp_path)]
    with running_server(cmd, tmp_path / "server.log", f"http://127.0.0.1:{port}/health", 30):
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it listens once the context is entered
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                break
        time.sleep(0.1)
    else:
        pytest.fail("the server still listens after the context closed")


def test_running_server_fails_at_once_when_the_server_exits(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import sys; sys.exit(3)"]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 3"):
        with running_server(cmd, tmp_path / "server.log", "http://127.0.0.1:9/health", 60):
            pass
    assert time.monotonic() - started < 30


def row(
    system: str,
    weights: str,
    workload: str,
    c: int | None,
    tok_s: float,
    tpot: float,
    rate: float | None = None,
    ttft: float = 100.0,
) -> dict:
    """One result row as ``measure`` writes it."""
    return {
        "system": system,
        "weights": weights,
        "workload": workload,
        "concurrency": c,
        "rate": rate,
        "output_tok_per_s": tok_s,
        "tpot_p50_ms": tpot,
        "ttft_p50_ms": ttft,
    }


def test_summary_pairs_ours_with_the_same_file_and_with_vllm() -> None:
    rows = [
        row("ours", "Q4_K_M", "chat", 8, 60.0, 50.0),
        row("llama.cpp", "Q4_K_M", "chat", 8, 20.0, 100.0),
        row("llama.cpp", "BF16", "chat", 8, 30.0, 80.0),
        row("vllm", "hf float32", "chat", 8, 40.0, 200.0),
        row("ours", "Q4_K_M", "long", 8, 90.0, 45.0),  # no peer in this workload: no pair
    ]
    got = real_size_serving.summary(rows)
    assert got == [
        {"workload": "chat", "concurrency": 8, "ours": "Q4_K_M", "peer": "llama.cpp Q4_K_M",
         "tok_s_ratio": 3.0, "tpot_ratio": 0.5, "ttft_ratio": 1.0},
        {"workload": "chat", "concurrency": 8, "ours": "Q4_K_M", "peer": "vllm hf float32",
         "tok_s_ratio": 1.5, "tpot_ratio": 0.25, "ttft_ratio": 1.0},
    ]  # fmt: skip


def test_summary_pairs_rate_runs_by_rate_and_the_plot_leaves_them_out(tmp_path: Path) -> None:
    rows = [
        row("ours", "BF16", "chat", None, 60.0, 50.0, rate=1.0, ttft=300.0),
        row("ours", "BF16", "chat", None, 90.0, 60.0, rate=2.0, ttft=500.0),
        row("vllm", "hf bfloat16", "chat", None, 60.0, 40.0, rate=1.0, ttft=200.0),
        row("vllm", "hf bfloat16", "chat", None, 100.0, 50.0, rate=2.0, ttft=1000.0),
        row("vllm", "hf bfloat16", "chat", 1, 30.0, 30.0),  # a concurrency run: not a rate's
    ]
    got = real_size_serving.summary(rows)
    assert [(line["rate"], line["ttft_ratio"]) for line in got] == [(1.0, 1.5), (2.0, 0.5)]
    assert all(line["concurrency"] is None for line in got)
    out = tmp_path / "plot.png"
    real_size_serving.plot(rows, ["chat"], out)  # only the concurrency run is drawn
    assert out.stat().st_size > 0


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rows = [row("ours", "Q4_K_M", w, c, 10.0 * c, 40.0 + c) for w in ("chat", "long")
            for c in (1, 8)]  # fmt: skip
    out = tmp_path / "plot.png"
    real_size_serving.plot(rows, ["chat", "long"], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_defaults_and_refusals() -> None:
    args = real_size_serving.parse_args([])
    assert args.concurrency == [1, 8, 32] and args.workloads == ["chat", "long"]
    assert args.rates == [] and args.rate_prompts == 16
    assert real_size_serving.parse_args(["--rates", "1", "2"]).rates == [1.0, 2.0]
    assert args.systems == ["ours", "llama.cpp", "vllm"]
    assert args.vllm_dtype == real_size_serving.vllm_best_dtype()
    assert real_size_serving.parse_args(["--vllm-dtype", "float32"]).vllm_dtype == "float32"
    with pytest.raises(SystemExit):
        real_size_serving.parse_args(["--systems", "tgi"])
