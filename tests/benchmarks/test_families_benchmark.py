"""benchmarks/families.py: a whole smoke run of the tiny shape (every row, the ratios against
llama, the routed share of the experts) and the active-parameter count of the 1B bodies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import families


def test_tiny_run_of_three_families(tmp_path: Path) -> None:
    out = tmp_path / "families.json"
    argv = ["--shape", "tiny", "--families", "qwen3_moe", "gemma3_hd256", "--batches", "1", "2"]
    result = families.main([*argv, "--prompt-len", "8", "--decode-steps", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows = {(r["family"], r["batch"]): r for r in result["results"]}
    assert [r["family"] for r in result["results"]][::2] == ["llama", "qwen3_moe", "gemma3_hd256"]
    assert set(rows) == {(f, b) for f in ("llama", "qwen3_moe", "gemma3_hd256") for b in (1, 2)}
    # llama is measured first and again right after each family: 3 samples per batch.
    samples = result["llama_samples"]
    assert [r["batch"] for r in samples] == [1, 2] * 3
    for (family, batch), row in rows.items():
        assert row["decode_step_ms"] > 0 and row["tok_s"] == pytest.approx(
            batch * 1e3 / row["decode_step_ms"], rel=0.02
        )
        if family == "llama":
            assert row["vs_llama"] == 1.0 and row["num_samples"] == 3
            continue
        # Each family against the llama sample taken right after it.
        position = [r["family"] for r in result["results"][2:]].index(family) // 2
        after = samples[2 * (position + 1) + (batch - 1)]
        assert row["llama_ms_per_active_b"] == after["ms_per_active_b"]
        expected = row["ms_per_active_b"] / after["ms_per_active_b"]
        assert row["vs_llama"] == pytest.approx(expected, abs=0.01)


def test_the_moe_bodies_are_about_as_active_as_llama(tmp_path: Path) -> None:
    """Active parameters per token of the 1B shapes: the MoE families' routed half of 4
    experts of MLP 4096 is llama's MLP 8192 (counted on meta tensors: nothing is allocated)."""
    import torch
    import transformers

    counts = {}
    for family in ("llama", "mixtral", "qwen3_moe", "phi3"):
        class_name, fields = families.FAMILIES[family]
        config = getattr(transformers, class_name)(**{**families.BODY, **fields})
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        counts[family] = families.active_params(model, config)
        if family == "mixtral":  # 8 tokens touch nearly all 4 experts: their weights are read
            touched = families.active_params(model, config, batch=8)
            experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
            assert touched - counts[family] == pytest.approx(experts * (0.5 - 0.5**8), rel=1e-6)
    assert counts["llama"] == pytest.approx(1.074e9, rel=0.001)
    assert counts["mixtral"] == pytest.approx(counts["llama"], rel=0.001)
    assert counts["qwen3_moe"] == pytest.approx(counts["llama"], rel=0.001)
    # Phi-3 unties its head: the LM head counts, the input table (a lookup) does not.
    assert counts["phi3"] == pytest.approx(counts["llama"], rel=0.001)


def test_the_3b_body_is_llama_3_2_3b_with_our_vocabulary() -> None:
    """``--shape 3b``: Llama-3.2-3B's body (3072 wide, 28 layers, 24 / 8 heads of 128,
    intermediate 8192, tied) with the 49k vocabulary: 2.97 B parameters (on meta tensors).
    Mixtures of experts have no 3B body, and an unknown shape is refused by name."""
    import torch
    import transformers

    for family in ("llama", "qwen3", "gemma3_hd256"):
        fields = families.body_fields(family, "3b")
        assert fields["num_attention_heads"] * fields["head_dim"] == 3072
        assert (fields["num_hidden_layers"], fields["num_key_value_heads"]) == (28, 8)
    config = transformers.LlamaConfig(**families.body_fields("llama", "3b"))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert families.active_params(model, config) == pytest.approx(2.97e9, rel=0.002)
    with pytest.raises(ValueError, match="mixture of experts"):
        families.body_fields("mixtral", "3b")
    with pytest.raises(ValueError, match="unknown shape '7b'"):
        families.body_fields("llama", "7b")
