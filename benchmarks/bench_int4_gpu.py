"""Microbenchmark: the Triton GPTQ int4 matmul against bf16 and dequantise-then-matmul.

On a GPU (the issue's target: the 8B int4 decode step at most 0.6x the bf16 one):

    python -m benchmarks.bench_int4_gpu [--shapes 8b] [--rows 1 32 256] [--group-size 128]
        [--act-order] [--sweep] [--out benchmarks/results/int4_gpu.json]

Per layer shape of the model (q|k|v, o_proj, gate|up, down) and batch rows it times, with CUDA
events (median of ``--iters``): ``F.linear`` on the bf16 weight, the Triton kernel on the
packed 4-bit weight, and the portable path (dequantise the whole weight, then matmul) that ran
on cuda before. ``--sweep`` also times every ``INT4_TUNING_SPACE`` launch and reports the best.
Random codes, zeros and scales: speed does not depend on the values.

``--device cpu`` runs a tiny shape in Triton's interpreter as a smoke test (numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks import median_kernel_seconds, run_kernel_benchmark

#: (in, out) of a layer's four matmuls.
SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "tiny": {"qkv": (64, 128), "down": (128, 64)},
    "1b": {
        "qkv": (2048, 3072),
        "o_proj": (2048, 2048),
        "gate_up": (2048, 16384),
        "down": (8192, 2048),
    },
    "8b": {
        "qkv": (4096, 6144),
        "o_proj": (4096, 4096),
        "gate_up": (4096, 28672),
        "down": (14336, 4096),
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["8b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 32, 256])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--act-order", action="store_true", help="a shuffled g_idx (desc_act)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def make_layer(in_features: int, out: int, args: argparse.Namespace):
    """A QuantLinear of random codes in the portable layout, and its dense weight [out, in]."""
    import torch

    from server.continuous_batching.quantization import QuantLinear

    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    groups = -(-in_features // args.group_size)
    gen = torch.Generator().manual_seed(in_features * out)
    packed = torch.randint(0, 256, (in_features // 2, out), dtype=torch.uint8, generator=gen)
    zeros = torch.randint(0, 16, (groups, out), generator=gen).to(dtype)
    scales = (torch.rand((groups, out), generator=gen) * 0.01).to(dtype)
    perm = torch.randperm(in_features, generator=gen).to(device) if args.act_order else None
    layer = QuantLinear(packed.to(device), zeros.to(device), scales.to(device), perm, None, None)
    return layer, layer.weight().t().contiguous()


def _median_seconds(fn: Callable[[], Any], args: argparse.Namespace) -> float:
    return median_kernel_seconds(fn, args.device, args.iters)


def _dequant_mm(layer, xs):
    """The portable path: the whole weight dequantised, then one matmul."""
    import torch

    return torch.mm(xs, layer.weight())


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """One row per (shape, layer, rows)."""
    import torch
    import torch.nn.functional as F

    from server.continuous_batching.quantization import triton_int4

    rows = []
    for shape in args.shapes:
        for name, (in_features, out) in SHAPES[shape].items():
            layer, dense = make_layer(in_features, out, args)
            g_idx = layer.row_group_index()
            for m in args.rows:
                x = torch.randn((m, in_features), dtype=dense.dtype, device=args.device)
                xs = layer._input(x)
                launches = [None] + (list(triton_int4.INT4_TUNING_SPACE) if args.sweep else [])
                kernel = []
                for launch in launches:
                    run = partial(
                        triton_int4.int4_matmul,
                        xs,
                        layer.packed,
                        layer.zeros,
                        layer.scales,
                        g_idx,
                        launch,
                    )
                    try:
                        seconds = _median_seconds(run, args)
                    except Exception as exc:  # noqa: BLE001 - a launch that does not compile
                        print(f"{shape} {name} m={m} {launch}: {exc}", flush=True)
                        continue
                    kernel.append((seconds, launch))
                dense_s = _median_seconds(partial(F.linear, x, dense), args)
                dequant_s = _median_seconds(partial(_dequant_mm, layer, xs), args)
                best_s, best = min(kernel, key=lambda t: t[0])
                row = {
                    "shape": shape,
                    "layer": name,
                    "rows": m,
                    "int4_us": kernel[0][0] * 1e6,
                    "dense_us": dense_s * 1e6,
                    "dequant_then_mm_us": dequant_s * 1e6,
                    "int4_over_dense": kernel[0][0] / dense_s,
                }
                if args.sweep:
                    row.update(best_int4_us=best_s * 1e6, best_launch=best and vars(best))
                print(json.dumps(row), flush=True)
                rows.append(row)
    return {"config": {**vars(args), "out": str(args.out)}, "results": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the microbenchmark; returns (and writes to ``--out``) its results."""
    return run_kernel_benchmark(bench, parse_args(argv), "bench_int4_gpu.py")


if __name__ == "__main__":
    main()
