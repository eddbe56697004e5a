"""Smoke test of the offline throughput benchmark: both sides run a tiny workload end to end.

No timing is asserted (the machine's cores are shared); only that the script runs, writes its
JSON and plot, and that every request got exactly its token budget on both sides.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import throughput
from benchmarks.workloads import (
    PROMPT_MAX_TOKENS,
    PROMPT_MIN_TOKENS,
    build_workload,
    chat_messages,
    mixed_new_tokens,
)
from server.continuous_batching.model import attention, cpu_isa
from server.continuous_batching.runner import model_runner

REQUIRED_KEYS = {
    "workload",
    "dtype",
    "num_threads",
    "engine_tokens_per_s",
    "transformers_tokens_per_s",
    "ratio",
    "engine_seconds",
    "transformers_seconds",
    "num_requests",
    "num_output_tokens",
    "transformers_padding_waste",
    "engine_stats",
    "torch_version",
    "timestamp",
}


def test_workloads_are_deterministic_and_in_range(default_model_path: Path) -> None:
    """Prompt lengths stay in 60-130 tokens; sets are prefix-stable; budgets follow the spec."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    uniform = build_workload("uniform", tokenizer)
    mixed = build_workload("mixed", tokenizer)
    assert len(uniform) == 32 and {r.max_new_tokens for r in uniform} == {128}
    assert len(mixed) == 64 and all(16 <= r.max_new_tokens <= 512 for r in mixed)
    assert [r.max_new_tokens for r in mixed] == mixed_new_tokens()
    assert all(PROMPT_MIN_TOKENS <= len(r.prompt_token_ids) <= PROMPT_MAX_TOKENS for r in mixed)
    assert [r.prompt_token_ids for r in uniform] == [r.prompt_token_ids for r in mixed[:32]]
    assert chat_messages(tokenizer, 5) == [r.messages for r in uniform[:5]]
    assert len({tuple(r.prompt_token_ids) for r in mixed}) == 64


@pytest.mark.slow
def test_throughput_smoke(default_model_path: Path, tmp_path: Path) -> None:
    """Three prompts, four new tokens, float32: both sides produce exactly 12 tokens."""
    json_path, plot_path = tmp_path / "result.json", tmp_path / "result.png"
    argv = ["--workload", "mixed", "--dtype", "float32", "--num-prompts", "3"]
    argv += ["--max-new-tokens", "4", "--model", str(default_model_path)]
    argv += ["--num-threads", "1"]  # one thread: no OpenMP barrier stalls when cores are shared
    threads = torch.get_num_threads()
    try:
        throughput.main([*argv, "--json", str(json_path), "--plot", str(plot_path)])
    finally:
        torch.set_num_threads(threads)  # main() sets the process-wide thread count
    result = json.loads(json_path.read_text())
    assert REQUIRED_KEYS <= result.keys()
    assert result["num_requests"] == 3 and result["num_output_tokens"] == 12
    assert result["engine_output_tokens"] == result["transformers_output_tokens"] == 12
    assert result["engine_stats"]["num_generated_tokens"] == 12
    assert result["transformers_padding_waste"] == 0.0
    assert result["ratio"] > 0
    # The run says which CPU path served (levels can be forced, so a figure needs its path).
    path = result["engine_compute_path"]
    assert path["device"] == "cpu" and path["isa"] in cpu_isa.LEVELS
    assert path["summary"].startswith("decoder ops: ")
    assert plot_path.stat().st_size > 0
    assert set(result["engine_profile"]["time_split_seconds"]) == {
        "schedule",
        "execute",
        "decode",
        "other",
    }
    # The profiler's wrappers are gone once the run is over.
    assert model_runner.plan_attention is attention.plan_attention
