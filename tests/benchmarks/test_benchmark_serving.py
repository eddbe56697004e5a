"""Smoke test of the online serving benchmark against a real SB server on 127.0.0.1.

No timing is asserted (the machine's cores are shared): only that the benchmark's coroutine runs
end to end, writes its JSON and plot with the documented fields, counts 4 tokens per request
(``ignore_eos``), and records failures instead of crashing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import serving
from harness.servers import ServerThread
from tests.support.default_model import MODEL_ID

STATS = {"mean", "p50", "p90", "p99"}
TOP_KEYS = {
    "label",
    "model",
    "config",
    "load_average_at_start",
    "load_average_at_end",
    "client_cpu_cores",
    "last_arrival_s",
    "duration_s",
    "completed",
    "failed",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "errors",
    "requests",
    "timestamp",
}


def quick_args(server: ServerThread, model_path: Path, *extra: str) -> list[str]:
    """Command line of a tiny run: 4 requests of 4 tokens at a high rate."""
    return [
        f"--base-url={server.url}/v1",
        f"--tokenizer={model_path}",
        "--num-requests=4",
        "--max-tokens=4",
        "--rate=100",
        "--ignore-eos",
        "--timeout=60",
        *extra,
    ]


async def test_serving_benchmark_reports_every_request(
    sb_server: ServerThread, default_model_path: Path, tmp_path: Path
) -> None:
    """4 streamed chats complete with exactly 4 tokens each; JSON and plot are written."""
    json_path, plot_path = tmp_path / "serving.json", tmp_path / "serving.png"
    argv = quick_args(sb_server, default_model_path, "--label=sb")
    result = await serving.amain([*argv, f"--json={json_path}", f"--plot={plot_path}"])

    assert json.loads(json_path.read_text()) == result
    assert plot_path.stat().st_size > 0
    assert TOP_KEYS <= result.keys()
    assert result["completed"] == 4 and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == 16
    assert [r["output_tokens"] for r in result["requests"]] == [4, 4, 4, 4]
    assert all(r["error"] is None and len(r["itls"]) >= 1 for r in result["requests"])
    for name in serving.METRICS:
        assert set(result[f"{name}_ms"]) == STATS
        assert all(v is not None and v >= 0 for v in result[f"{name}_ms"].values())
    assert result["model"] == MODEL_ID  # the default: the first of GET /v1/models
    assert result["config"]["endpoint"] == "chat" and result["config"]["rate"] == "100.0"


async def test_serving_benchmark_completions_endpoint(
    sb_server: ServerThread, default_model_path: Path
) -> None:
    """``--endpoint completions`` sends the rendered prompt text; tokens come from ``usage``."""
    argv = quick_args(sb_server, default_model_path, "--endpoint=completions", "--max-tokens=2")
    result = await serving.amain(argv)
    assert result["completed"] == 4, result["errors"]
    assert [r["output_tokens"] for r in result["requests"]] == [2, 2, 2, 2]


async def test_serving_benchmark_counts_failures(
    sb_server: ServerThread, default_model_path: Path
) -> None:
    """Refused requests (an unknown model: 404) are counted as failed, never raised."""
    argv = quick_args(sb_server, default_model_path, "--model=no-such-model")
    result = await serving.amain(argv)
    assert result["completed"] == 0 and result["failed"] == 4
    assert result["errors"] and result["errors"][0].startswith("HTTP 404")
    assert result["ttft_ms"]["p50"] is None and result["output_throughput"] == 0


def test_poisson_arrivals_are_seeded() -> None:
    """Same seed, same schedule; the mean gap follows the rate; inf sends all at t=0."""
    first = serving.arrival_times(2000, 4.0, seed=7)
    assert first == serving.arrival_times(2000, 4.0, seed=7)
    assert first[0] == 0.0 and first != serving.arrival_times(2000, 4.0, seed=8)
    assert first[-1] / (len(first) - 1) == pytest.approx(0.25, rel=0.1)
    assert serving.arrival_times(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
