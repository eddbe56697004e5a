"""Microbenchmark: the Triton paged decode-attention kernel alone against its bandwidth floor.

On a GPU (the issue's target: at least 60% of HBM bandwidth at batch 256, contexts 200-2,000):

    python -m benchmarks.bench_decode_attention [--batch 256] [--contexts 200 500 1000 2000]
        [--heads 32] [--kv-heads 8] [--head-dim 128] [--dtype bfloat16] [--bandwidth-gbs 3350]
        [--sweep] [--out benchmarks/results/decode_attention.json]

One layer's attention: ``batch`` sequences of ``context`` keys each in a paged cache (16-token
blocks, shuffled so that no two neighbouring blocks are neighbours in memory), one query token
per sequence. Per context it reports the kernel's time (CUDA events, median of ``--iters``
launches after a warm-up), the bytes a launch must read (every K and V row once, plus q, the
block tables and the output), the GB/s that makes and its fraction of ``--bandwidth-gbs``.
``--sweep`` times every launch configuration of ``DECODE_TUNING_SPACE`` (tile, warps, stages)
and reports the best per context; the default times ``GPU_LAUNCH``.

On a CPU it runs in Triton's interpreter (``--device cpu`` sets ``TRITON_INTERPRET=1``) with
tiny shapes, as a smoke test: the numbers then say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import median_kernel_seconds, run_kernel_benchmark

H100_GBS = 3350.0
BLOCK_SIZE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", nargs="+", type=int, default=[200, 500, 1000, 2000])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (interpreter smoke run)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--bandwidth-gbs", type=float, default=H100_GBS)
    parser.add_argument("--sweep", action="store_true", help="time DECODE_TUNING_SPACE too")
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    return parser.parse_args(argv)


def make_case(args: argparse.Namespace, context: int) -> dict[str, Any]:
    """Random q, caches and shuffled block tables for ``args.batch`` sequences."""
    import torch

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(context)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = args.batch * blocks_per_seq + 1
    slots = num_blocks * BLOCK_SIZE
    shape = (slots, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=args.device)
    v_cache = torch.randn(shape, dtype=dtype, device=args.device)
    q = torch.randn((args.batch, args.heads, args.head_dim), dtype=dtype, device=args.device)
    order = torch.randperm(num_blocks, generator=gen)[: args.batch * blocks_per_seq]
    tables = order.view(args.batch, blocks_per_seq).to(torch.int32).to(args.device)
    lens = torch.full((args.batch,), context, dtype=torch.int32, device=args.device)
    kv_bytes = 2 * args.batch * context * args.kv_heads * args.head_dim * dtype.itemsize
    other = 2 * q.numel() * q.element_size() + tables.numel() * 4 + lens.numel() * 4
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": tables,
        "context_lens": lens,
        "bytes": kv_bytes + other,
    }


def time_launch(case: dict[str, Any], context: int, args: argparse.Namespace, launch) -> float:
    """Median seconds of one kernel launch (CUDA events on a GPU, the wall clock on a CPU)."""
    import torch

    from server.continuous_batching.model import triton_paged_attention as tpa

    out = torch.empty_like(case["q"])

    def run() -> None:
        tpa.paged_decode_attention(
            case["q"],
            case["k_cache"],
            case["v_cache"],
            case["block_tables"],
            case["context_lens"],
            BLOCK_SIZE,
            context,
            out=out,
            launch=launch,
        )

    return median_kernel_seconds(run, args.device, args.iters)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """One row per context (the default launch, and the best of the sweep when asked)."""
    import torch

    from server.continuous_batching.model import triton_paged_attention as tpa

    launches = [None]  # None: the kernel's own default for the device
    if args.sweep:
        launches += list(tpa.DECODE_TUNING_SPACE)
    rows = []
    for context in args.contexts:
        case = make_case(args, context)
        floor_s = case["bytes"] / (args.bandwidth_gbs * 1e9)
        timings = []
        for launch in launches:
            try:
                seconds = time_launch(case, context, args, launch)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile
                print(f"context {context}, {launch}: {type(exc).__name__}: {exc}", flush=True)
                continue
            timings.append((seconds, launch))
        default_s = timings[0][0]
        best_s, best = min(timings, key=lambda t: t[0])
        row = {
            "batch": args.batch,
            "context": context,
            "bytes": case["bytes"],
            "floor_us": floor_s * 1e6,
            "kernel_us": default_s * 1e6,
            "gb_s": case["bytes"] / default_s / 1e9,
            "fraction_of_bandwidth": floor_s / default_s,
            "partition": tpa.choose_partition(
                args.batch, args.kv_heads, context, (best or tpa.GPU_LAUNCH).tile
            ),
        }
        if args.sweep:
            row.update(
                best_launch=None if best is None else vars(best),
                best_kernel_us=best_s * 1e6,
                best_fraction_of_bandwidth=floor_s / best_s,
            )
        print(json.dumps(row), flush=True)
        rows.append(row)
        del case
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    meta = {**vars(args), "out": str(args.out), "torch": torch.__version__}
    if args.device.startswith("cuda"):
        meta["device_name"] = torch.cuda.get_device_name()
    return {"config": meta, "results": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the microbenchmark; returns (and writes to ``--out``) its results."""
    return run_kernel_benchmark(bench, parse_args(argv), "bench_decode_attention.py")


if __name__ == "__main__":
    main()
