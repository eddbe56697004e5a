"""benchmarks/gpu.py off a GPU: it imports, parses its defaults, computes the bandwidth floor
the design quotes, plots, and refuses to run without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import gpu


def test_defaults() -> None:
    args = gpu.parse_args([])
    assert args.shapes == ["1b"] and args.batches == [1, 32, 256]
    assert args.systems == ["engine", "hf", "hf-compile"] and not args.enforce_eager


def test_bandwidth_floor_of_the_1b_shape_at_batch_32() -> None:
    """DESIGN.md: 0.78 ms for the 1B llama (bf16) at batch 32 over ~3 TB/s."""
    s = gpu.SHAPES["1b"]
    hidden, inter, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    head_dim = hidden // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * head_dim
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter
    weight_bytes = 2 * (layers * per_layer + gpu.VOCAB_SIZE * hidden)
    kv_per_token = 2 * layers * kv * 2
    floor = gpu.bandwidth_floor_ms(weight_bytes, kv_per_token, 32, 128 + 64, 3000.0)
    assert floor == pytest.approx(0.78, abs=0.02)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rows = [
        {"shape": "1b", "system": system, "batch": batch, "tok_s": float(batch)}
        for system in ("engine", "hf")
        for batch in (1, 32)
    ]
    gpu.plot(rows, tmp_path / "gpu.png")
    assert (tmp_path / "gpu.png").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_cuda() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        gpu.main([])
