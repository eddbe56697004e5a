"""benchmarks/at_load.py: a smoke run of the tiny shape: each variant loads quantised as named,
and its ratio is against the mean of the bf16 samples taken right before and after it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import at_load


def test_tiny_run_of_two_variants(tmp_path: Path) -> None:
    out = tmp_path / "at_load.json"
    argv = ["--shape", "tiny", "--variants", "int8", "int4-i8", "--batches", "1", "2"]
    result = at_load.main([*argv, "--prompt-len", "8", "--decode-steps", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows = result["results"]
    # bf16, int8, bf16, int4-i8, bf16: two rows (batches 1 and 2) each.
    assert [r["family"] for r in rows][::2] == ["bf16", "int8", "bf16", "int4-i8", "bf16"]
    for index in (2, 3, 6, 7):
        row, before, after = rows[index], rows[index - 2], rows[index + 2]
        assert row["batch"] == before["batch"] == after["batch"]
        base = (before["decode_step_ms"] + after["decode_step_ms"]) / 2
        assert row["vs_bf16"] == pytest.approx(row["decode_step_ms"] / base, abs=0.01)
    assert rows[2]["weights"].startswith("int8 at load (Q8_0 packed int8")
    assert "int8 activations" in rows[6]["weights"] and "Q4_1 packed int4" in rows[6]["weights"]
