"""The vLLM comparison's own logic, without vLLM (it is no project dependency and CI has none).

What is checked: the environment script gives every vLLM run the shim, the thread binding and
the KV space (the comparison is meaningless without them); the serving ratios pair each of our
runs with vLLM's run of the same client, rate and round; each run draws prompts of its own;
the tables print with missing values; and the command line refuses to start without a vLLM
venv.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from benchmarks import vs_vllm, vs_vllm_serving


def test_env_script_sets_shim_binding_and_kv_space(tmp_path: Path) -> None:
    """``vllm_command`` runs its argv under ``vllm_env.sh``: shim first on PYTHONPATH, both
    cores bound, a small KV cache, our venv variables; nothing is preloaded that is not there."""
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    printed = subprocess.run(
        vs_vllm.vllm_command(venv, ["env"]), capture_output=True, text=True, check=True
    ).stdout
    env = dict(line.split("=", 1) for line in printed.splitlines() if "=" in line)
    shim = vs_vllm.REPO_ROOT.parent / "shared" / "peers" / "shim"
    assert env["PYTHONPATH"].split(":")[0] == str(shim)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["PEER_VLLM_PY"] == f"{venv}/bin/python"
    assert str(venv / "lib" / "libiomp5.so") not in env.get("LD_PRELOAD", "")


def test_env_script_keeps_exported_values(tmp_path: Path) -> None:
    """A value exported before the run wins (how a run overrides a knob)."""
    command = vs_vllm.vllm_command(tmp_path, ["env"])
    environ = {"PATH": "/usr/bin:/bin", "VLLM_CPU_KVCACHE_SPACE": "4", "PEER_VLLM_PRELOAD": "0"}
    printed = subprocess.run(command, capture_output=True, text=True, check=True, env=environ)
    env = dict(line.split("=", 1) for line in printed.stdout.splitlines() if "=" in line)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "LD_PRELOAD" not in env


def record(side: str, client: str, rate: float, tok_s: float | None, ttft: float) -> dict:
    """One serving record as ``measure_server`` writes it."""
    return {
        "side": side,
        "client": client,
        "rate": rate,
        "round": 0,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": ttft * 2,
        "tpot_p50_ms": 40.0,
        "req_per_s": 1.0,
        "output_tok_per_s": tok_s,
        "completed": 4,
        "failed": 0,
    }


def test_serving_ratios_pair_same_client_rate_and_round(capsys: pytest.CaptureFixture) -> None:
    records = [
        record("ours", "vllm", 2.0, 300.0, 100.0),
        record("vllm", "vllm", 2.0, 200.0, 50.0),
        record("ours", "vllm", math.inf, None, 80.0),
        record("vllm", "vllm", math.inf, 400.0, 40.0),
        record("ours", "ours", 2.0, 100.0, 10.0),  # no vLLM run of this client: no ratio
    ]
    ratios = vs_vllm_serving.serving_ratios(records)
    assert [(r["client"], r["rate"]) for r in ratios] == [("vllm", 2.0), ("vllm", math.inf)]
    assert ratios[0]["output_tok_per_s"] == 1.5
    assert ratios[0]["ttft_p50_ms"] == 2.0
    assert ratios[1]["output_tok_per_s"] is None  # a missing figure gives no ratio
    vs_vllm_serving.print_serving({"records": records, "ratios": ratios})
    out = capsys.readouterr().out
    assert "1.50x" in out and "2.00x" in out


def test_offline_table_prints_with_one_side(capsys: pytest.CaptureFixture) -> None:
    workload = {"num_requests": 4, "num_output_tokens": 64, "ours_tokens_per_s": [12.0]}
    workload |= {"vllm_tokens_per_s": [], "ours_median": 12.0, "vllm_median": None}
    workload |= {"ratio_of_medians": None, "ratio_per_repeat": []}
    result = {"dtype": "bfloat16", "num_threads": 2, "workloads": {"uniform": workload}}
    vs_vllm.print_offline(result)
    assert "uniform" in capsys.readouterr().out


def test_refuses_to_run_without_a_vllm_venv(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        vs_vllm.parse_args(["offline", "--vllm-venv", str(tmp_path / "none")])


def test_each_run_draws_its_own_prompts() -> None:
    # One seed for all runs would let every run after the first hit the prefix caches.
    seeds = [vs_vllm_serving.run_seed(r, i) for r in range(3) for i in range(6)]
    assert len(set(seeds)) == len(seeds)
    assert vs_vllm_serving.WARMUP_SEED not in seeds


def test_vllm_may_run_in_a_dtype_of_its_own(capsys: pytest.CaptureFixture) -> None:
    # On an AVX2-only CPU vLLM's best is float32 while ours stays bfloat16.
    import argparse

    assert vs_vllm.vllm_dtype(argparse.Namespace(dtype="bfloat16", vllm_dtype=None)) == "bfloat16"
    both = argparse.Namespace(dtype="bfloat16", vllm_dtype="float32")
    assert vs_vllm.vllm_dtype(both) == "float32"
    workload = {"num_requests": 4, "num_output_tokens": 64, "ours_tokens_per_s": [12.0]}
    workload |= {"vllm_tokens_per_s": [6.0], "ours_median": 12.0, "vllm_median": 6.0}
    workload |= {"ratio_of_medians": 2.0, "ratio_per_repeat": [2.0]}
    result = {"dtype": "bfloat16", "vllm_dtype": "float32", "num_threads": 2}
    vs_vllm.print_offline(result | {"workloads": {"uniform": workload}})
    assert "ours bfloat16, vLLM float32" in capsys.readouterr().out
