"""benchmarks/bench_decode_attention.py off a GPU: a tiny run in Triton's interpreter, as a
module from the checkout, writes one row per context with its bytes and bandwidth fraction."""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks.runs import needs_triton, results_of, run_benchmark

pytestmark = needs_triton


def test_tiny_interpreted_run(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    run_benchmark(
        "bench_decode_attention",
        *("--device", "cpu", "--batch", "2", "--contexts", "20", "40"),
        *("--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "float32"),
        *("--iters", "1", "--out", str(out)),
    )
    rows = results_of(out)
    assert [r["context"] for r in rows] == [20, 40]
    # K and V of 2 x 40 keys x 2 kv heads x 16 dims in float32, plus q, tables, lens, out.
    assert rows[1]["bytes"] == 2 * 2 * 40 * 2 * 16 * 4 + 2 * 2 * 4 * 16 * 4 + 2 * 3 * 4 + 2 * 4
    assert all(r["kernel_us"] > 0 and 0 < r["fraction_of_bandwidth"] for r in rows)
