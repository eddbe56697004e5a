"""Decode speed of a dense 1B llama quantised at load (``quantize_method: int8 | int4``),
against the same checkpoint in bf16 measured right before and after (issue #32).

Llama 1B's body (``benchmarks.families.BODY``) is written once as a random bf16 checkpoint;
the bf16 engine stays loaded and is measured again after each variant, whose ratio is against
the mean of its two adjacent bf16 samples (a 2-core machine drifts between minutes):

    python -m benchmarks.at_load [--variants int8 int4 int4-i8] [--batches 1 8]
        [--decode-steps 16] [--shape tiny] [--out benchmarks/results/at_load_cpu.json]

A variant is ``METHOD`` (float activations) or ``METHOD-i8`` (int8 activations). Per row:
the steady decode step (ms), tok/s, the load time and ``vs_bf16`` (step / bf16's step: below
1 is faster).
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

import torch

from benchmarks import run_environment, wait_for_quiet_machine, write_json
from benchmarks.families import build_checkpoint, measure
from benchmarks.families import parse_args as families_args
from benchmarks.gpu import REPO_ROOT, EngineBench


def loaded(folder: Path, args: argparse.Namespace, variant: str) -> tuple[EngineBench, float]:
    """An engine over ``folder`` for ``variant`` ("bf16", "int4", "int4-i8", ...)."""
    mine = copy.copy(args)
    method, _, activations = variant.partition("-")
    mine.quantize_method = None if method == "bf16" else method
    mine.gguf_activations = "int8" if activations == "i8" else "float"
    start = time.perf_counter()
    bench = EngineBench(folder, mine)
    return bench, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the variants; print one JSON row per measurement and write ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["int8", "int4", "int4-i8"])
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks/results/at_load_cpu.json"
    )
    ours, rest = parser.parse_known_args(argv)
    args = families_args(rest)
    waited = wait_for_quiet_machine(args.wait_for_load)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="at-load-") as tmp:
        folder = Path(tmp) / "llama"
        num_active = build_checkpoint("llama", folder, torch.bfloat16, args.batches, args.shape)
        dense, _ = loaded(folder, args, "bf16")
        try:
            before = measure(dense, "bf16", num_active, args)
            for variant in ours.variants:
                bench, seconds = loaded(folder, args, variant)
                try:
                    mine = measure(bench, variant, num_active, args)
                    weights = bench.runner.model.weight_format
                finally:
                    bench.close()
                after = measure(dense, "bf16", num_active, args)
                for row, b0, b1 in zip(mine, before, after, strict=True):
                    base = statistics.fmean([b0["decode_step_ms"], b1["decode_step_ms"]])
                    row.update(load_seconds=round(seconds, 1), weights=weights)
                    row["vs_bf16"] = round(row["decode_step_ms"] / base, 2)
                    print(json.dumps(row), flush=True)
                rows += before + mine
                before = after
            rows += before
        finally:
            dense.close()
    result = {"config": {**vars(args), **vars(ours)}, "waited_seconds": waited,
              "environment": run_environment(), "results": rows}  # fmt: skip
    result["config"] = {
        k: str(v) if isinstance(v, Path) else v for k, v in result["config"].items()
    }
    write_json(result, ours.out)
    print(f"wrote {ours.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
