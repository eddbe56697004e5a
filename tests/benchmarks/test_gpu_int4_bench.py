"""benchmarks/bench_int4_gpu.py off a GPU: a tiny act-order run in Triton's interpreter, as a
module from the checkout, writes one row per layer and batch."""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks.runs import needs_triton, results_of, run_benchmark

pytestmark = needs_triton


def test_tiny_interpreted_run(tmp_path: Path) -> None:
    out = tmp_path / "int4.json"
    run_benchmark(
        "bench_int4_gpu",
        *("--device", "cpu", "--shapes", "tiny", "--rows", "1", "3", "--group-size", "32"),
        *("--act-order", "--dtype", "float32", "--iters", "1", "--out", str(out)),
    )
    layers = [(r["layer"], r["rows"]) for r in results_of(out)]
    assert layers == [("qkv", 1), ("qkv", 3), ("down", 1), ("down", 3)]
    assert all(r["int4_us"] > 0 and r["dense_us"] > 0 for r in results_of(out))
