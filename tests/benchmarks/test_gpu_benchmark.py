"""benchmarks/gpu.py off a GPU: its defaults, the bandwidth floor the issue quotes, the plot,
the refusal without CUDA, and a whole run of the tiny shape on the CPU (engine and
transformers' static-cache path) that writes its JSON and plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu
from tests.benchmarks.runs import run_benchmark


def test_defaults() -> None:
    args = gpu.parse_args([])
    assert args.shapes == ["1b", "8b"] and args.batches == [1, 32, 256]
    assert args.systems == ["engine", "hf-compile"] and not args.enforce_eager
    assert args.bandwidth_gbs == 3350.0 and args.decode_steps == 50 and args.device == "cuda"
    assert gpu.parse_args(["--shape", "tiny"]).shapes == ["tiny"]


def _weight_bytes(shape: str) -> int:
    s = gpu.SHAPES[shape]
    hidden, inter, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    kv = s["num_key_value_heads"] * hidden // s["num_attention_heads"]
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter
    return 2 * (layers * per_layer + gpu.VOCAB_SIZE * hidden)


def test_bandwidth_floor_of_the_1b_shape_at_batch_32() -> None:
    """DESIGN.md: 0.78 ms for the 1B llama (bf16) at batch 32 over ~3 TB/s."""
    kv_per_token = gpu.kv_bytes_per_token("1b", torch.bfloat16)
    floor = gpu.bandwidth_floor_ms(_weight_bytes("1b"), kv_per_token, 32, 128 + 64, 3000.0)
    assert floor == pytest.approx(0.78, abs=0.02)


def test_the_8b_shape_holds_about_16_gb_of_bf16_weights() -> None:
    assert _weight_bytes("8b") / 1e9 == pytest.approx(14.4, abs=0.2)  # 32 layers, no big vocab
    assert gpu.kv_bytes_per_token("8b", torch.bfloat16) == 2 * 32 * 8 * 128 * 2


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rows = [
        {
            "shape": "1b",
            "system": system,
            "batch": batch,
            "tok_s": float(batch),
            "decode_step_ms": 1.0,
            "bandwidth_floor_ms": 0.5,
        }
        for system in ("engine", "hf-compile")
        for batch in (1, 32)
    ]
    assert gpu.plot(rows, tmp_path / "gpu.png")
    assert (tmp_path / "gpu.png").stat().st_size > 0


def test_plot_is_skipped_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert not gpu.plot([], tmp_path / "gpu.png")
    assert "plot skipped" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_cuda() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        gpu.main([])


def test_tiny_shape_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    """The whole benchmark as a module from the checkout (not installed, no PYTHONPATH): both
    systems, two batches, JSON and plot."""
    out = tmp_path / "gpu.json"
    run_benchmark(
        "gpu",
        *("--shape", "tiny", "--device", "cpu", "--dtype", "float32"),
        *("--batches", "1", "3", "--prompt-len", "8", "--new-tokens", "5"),
        *("--decode-steps", "2", "--systems", "engine", "hf-compile", "--out", str(out)),
    )
    result = json.loads(out.read_text())
    rows = result["results"]
    assert [(r["system"], r["batch"]) for r in rows] == [
        ("engine", 1),
        ("engine", 3),
        ("hf-compile", 1),
        ("hf-compile", 3),
    ]
    for row in rows:
        assert row["tok_s"] > 0 and row["decode_step_ms"] > 0 and row["bandwidth_floor_ms"] > 0
    engine = rows[0]
    assert 0 < engine["host_ms_per_step"] <= engine["decode_step_ms"]
    assert engine["mean_context"] > 8
    assert not rows[2]["compiled"]  # transformers compiles on cuda only
    assert {r["versus"] for r in result["ratios"]} == {"hf-compile"}
    assert out.with_suffix(".png").stat().st_size > 0


def test_step_profile_names_the_engine_step(capsys) -> None:
    """The host-time profile (benchmarks.step_profile) runs on a CPU and its tables cover
    exactly the requested steps of ``LLMEngine.step``."""
    from benchmarks import step_profile

    step_profile.main(["--shape", "tiny", "--batch", "3", "--device", "cpu", "--steps", "2"])
    printed = capsys.readouterr().out
    assert "--- per 2 steps, by tottime ---" in printed
    step_lines = [line for line in printed.splitlines() if "engine.py" in line and "(step)" in line]
    assert step_lines and step_lines[0].split()[0] == "3"  # 2 timed + the prefill step
