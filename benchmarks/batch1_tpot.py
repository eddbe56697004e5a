"""Batch-1 decode served, ours against llama-server on the same GGUF, interleaved (issue #32's
batch-1 targets: TPOT at most 0.9x llama.cpp's for Q4_K_M and Q8_0).

    python -m benchmarks.batch1_tpot [--types Q4_K_M Q8_0] [--rounds 12] [--max-tokens 200]
        [--threads 2] [--out benchmarks/results/batch1_tpot_cpu.json]

Both servers of a type are up at once (``llm-suite serve FILE`` and ``llama-server -m FILE
--parallel 1``, as ``real_size_serving`` starts them), idle but for the one request in
flight: per round, one streamed completion to each in turn (greedy, ``ignore_eos``,
``--max-tokens`` tokens after a ~100-token prompt). On this project's 2-core machines the
memory bandwidth drifts by a fifth within minutes, so runs of one server after the other
(``real_size_serving`` at concurrency 1) can land on different sides of a drift; alternating
request by request puts both on the same side. Per request: TPOT = (last chunk - first chunk)
/ (tokens - 1), the tokens from the stream's usage. Per type: each system's median TPOT and
the ratio ours / llama.cpp (below 1: we are faster).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import run_environment, write_json
from benchmarks.families import add_shape_argument
from benchmarks.gpu import REPO_ROOT
from benchmarks.real_size_serving import (
    MODEL_NAME,
    add_llama_cpp_isa,
    checkpoint,
    ggufs,
    serve_llama_cpp,
    serve_ours,
)

#: Words of the prompt (about 100 tokens with the default tokenizer).
PROMPT = "Write a long story about a robot who learns to paint in an old city. " * 7


def streamed_tpot(base: str, max_tokens: int, timeout: float) -> dict[str, float]:
    """One streamed greedy completion of ``max_tokens`` tokens: its TPOT in ms."""
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals: list[float] = []
    num_tokens = max_tokens
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=timeout) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                num_tokens = int(chunk["usage"]["completion_tokens"])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    if len(arrivals) < 2 or num_tokens < 2:
        raise RuntimeError(f"{base} streamed {len(arrivals)} chunks, {num_tokens} tokens")
    return {"tpot_ms": (arrivals[-1] - arrivals[0]) / (num_tokens - 1) * 1e3, "tokens": num_tokens}


def measure_type(args: argparse.Namespace, gguf: Path, work: Path) -> dict[str, Any]:
    """Both servers on ``gguf``, ``args.rounds`` rounds of one request each in turn."""
    ours_args, llama_args = copy.copy(args), copy.copy(args)
    llama_args.port = args.port + 10  # ours takes the next ports for its CB server
    samples: dict[str, list[float]] = {"ours": [], "llama.cpp": []}
    with serve_ours(ours_args, gguf, work) as ours, serve_llama_cpp(llama_args, gguf, work) as lc:
        bases = {"ours": ours, "llama.cpp": lc}
        for base in bases.values():  # warm-up: first-call allocations, caches
            streamed_tpot(base, 16, args.timeout)
        for index in range(args.rounds):
            for system, base in bases.items():
                got = streamed_tpot(base, args.max_tokens, args.timeout)
                samples[system].append(round(got["tpot_ms"], 3))
                print(f"round {index} {system:9s} TPOT {got['tpot_ms']:6.2f} ms", flush=True)
    medians = {system: statistics.median(values) for system, values in samples.items()}
    return {
        "weights": gguf.stem.removeprefix("model-"),
        "tpot_ms": samples,
        "median_tpot_ms": medians,
        "ours_vs_llama_cpp": round(medians["ours"] / medians["llama.cpp"], 3),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0"], help="GGUF types")
    p.add_argument("--rounds", type=int, default=12, help="requests to each server (12)")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens per request (200)")
    add_shape_argument(p)
    p.add_argument("--threads", type=int, default=2, help="threads of each server (2)")
    add_llama_cpp_isa(p)
    p.add_argument("--port", type=int, default=18400, help="ours; llama-server at +10")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    default_out = REPO_ROOT / "benchmarks/results/batch1_tpot_cpu.json"
    p.add_argument("--out", type=Path, default=default_out)
    args = p.parse_args(argv)
    # What serve_ours / serve_llama_cpp read: one slot, contexts of the longest request.
    args.concurrency, args.rates, args.workloads = [1], [], ["long"]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every type; write the JSON."""
    args = parse_args(argv)
    files = ggufs(checkpoint(args.shape), args.types)
    work = Path(tempfile.mkdtemp(prefix="batch1_tpot_"))
    rows = []
    for gguf in files.values():
        rows.append(measure_type(args, gguf, work))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "tpot_ms"}), flush=True)
    result = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "environment": run_environment(),
        "results": rows,
    }
    write_json(result, args.out)
    print(f"wrote {args.out} (server logs in {work})", flush=True)
    return result


if __name__ == "__main__":
    main()
