"""benchmarks/cpu_peak.py: the model's GMAC per token, the served rows put against the peaks,
and the C++ program built and run for an AVX2-only CPU (what this project's reference machine
is) as well as for this one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cpu_peak import ceilings, compare, measure_peaks, model_macs

LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 16,
    "vocab_size": 49152,
}


def test_model_macs_count_every_matmul_of_a_llama() -> None:
    body, head = model_macs(LLAMA_1B)
    # per layer: q (2048 x 2048), k and v (2048 x 512 each), o (2048 x 2048), gate/up/down
    per_layer = 2048 * 2048 + 2 * 2048 * 512 + 2048 * 2048 + 3 * 2048 * 8192
    assert body == pytest.approx(16 * per_layer / 1e9)
    assert head == pytest.approx(2048 * 49152 / 1e9)
    # head_dim given apart from hidden / heads (Qwen3, Gemma) changes q, k, v and o
    body_128, _ = model_macs(LLAMA_1B | {"head_dim": 128})
    assert body_128 == pytest.approx(16 * (per_layer + 2048 * 2048 * 2 + 2 * 2048 * 512) / 1e9)


def test_served_rows_against_the_ceilings(tmp_path: Path) -> None:
    peaks = {"fp32_fma": [100.0, 200.0], "bf16_dot": [250.0, 500.0], "read_gb_s": 50.0}
    body, head = 1.0, 0.1
    limits = ceilings(peaks, body, head)
    assert limits["batch1_tpot_floor_ms"] == pytest.approx(2 * 1.1 / 50.0 * 1e3)
    # chat: every output token costs its decode pass and 100/64 of a prompt token's body
    assert limits["chat_tok_s_ceiling"] == pytest.approx(500.0 / (1.1 + 100 / 64))
    row = {"workload": "chat", "rate": None, "failed": 0}
    results = [
        row
        | {
            "system": "vllm",
            "weights": "hf bfloat16",
            "concurrency": 32,
            "output_tok_per_s": 100.0,
            "tpot_p50_ms": 150.0,
        },
        row
        | {
            "system": "ours",
            "weights": "BF16",
            "concurrency": 1,
            "output_tok_per_s": 20.0,
            "tpot_p50_ms": 44.0,
        },
        row
        | {
            "system": "ours",
            "weights": "Q4_K_M",
            "concurrency": 32,
            "output_tok_per_s": 160.0,
            "tpot_p50_ms": 120.0,
        },
        row
        | {
            "system": "ours",
            "weights": "BF16",
            "concurrency": 1,
            "rate": 2.0,
            "output_tok_per_s": 30.0,
            "tpot_p50_ms": 40.0,
        },
    ]
    path = tmp_path / "served.json"
    path.write_text(json.dumps({"results": results}))
    rows = compare(path, peaks, body, head)
    assert [(r["system"], r["concurrency"]) for r in rows] == [("vllm", 32), ("ours", 1)]
    vllm, ours = rows
    assert vllm["matmul_gmac_s"] == pytest.approx(100.0 * (1.1 + 100 / 64), abs=0.06)
    assert vllm["of_bf16_peak"] == pytest.approx(vllm["matmul_gmac_s"] / 500.0, abs=1e-3)
    assert "read_gb_s" not in vllm
    assert ours["read_gb_s"] == pytest.approx(2 * 1.1 / 0.044, abs=0.06)
    assert ours["of_read_bandwidth"] == pytest.approx(ours["read_gb_s"] / 50.0, abs=1e-3)


@pytest.mark.parametrize("march", ["haswell", "native"])
def test_the_program_builds_and_measures(march: str) -> None:
    peaks = measure_peaks(2, march)
    one, two = peaks["fp32_fma"]
    assert one > 0 and two > 0 and peaks["read_gb_s"] > 0
    if march == "haswell":  # AVX2 only: no bf16 or int8 dot products to time
        assert set(peaks) == {"fp32_fma", "read_gb_s"}
