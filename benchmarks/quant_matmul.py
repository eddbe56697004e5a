"""Micro-benchmark of the CPU matmuls over weights kept quantised (``quant_linear``, GGUF
Q8_0 and Q4_K repacked) against the packed bfloat16 matmul (``bf16_linear``), at the 1B
llama's shapes. Run by hand (not a test; about half a minute):

    .venv/bin/python -m benchmarks.quant_matmul [--isa avx2] [--seconds 0.3] [--threads 1]

Per shape (K x N) and batch M (``--batches``; 1: decode, 8: a small batch, 128: a prefill),
float32 activations and (``i8``, where the kernels have them) int8 activations: milliseconds
per call (median of repeated runs), GB/s of weight bytes read (the packed bytes, scales
included), GMAC/s (M x N x K a second) and the speed against bf16 in the same run (>1: faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from server.continuous_batching.model import cpu_isa, cpu_kernels
from server.continuous_batching.quantization.packed_gguf import repack
from server.continuous_batching.quantization.packed_linear import PackedLinear

SHAPES = ((2048, 2048), (2048, 8192), (8192, 2048))  # (K, N)
BATCHES = (1, 8)


def _q4_k_blocks(rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K bytes (gguf cannot quantise to it) with small finite d and dmin."""
    blocks = rng.integers(0, 256, (rows, k // 256, 144), dtype=np.uint8)
    scales = (rng.uniform(1e-4, 1e-3, (rows, k // 256, 2))).astype(np.float16)
    blocks[..., 0:4] = scales.view(np.uint8).reshape(rows, k // 256, 4)
    return blocks.reshape(rows, -1)


def _time(call: Callable[[], object], seconds: float) -> float:
    """Median seconds per call over batches of calls filling about ``seconds``."""
    for _ in range(3):
        call()
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds / 5 or count < 3:
        call()
        count += 1
    per_batch = max(1, count // 5)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            call()
        samples.append((time.perf_counter() - t0) / per_batch)
    return statistics.median(samples)


def run(isa: str, seconds: float, batches: tuple[int, ...] = BATCHES) -> None:
    """Print the table for kernels of ``isa``."""
    kernels = cpu_kernels.load(isa)
    if kernels is None or not hasattr(kernels, "quant_linear"):
        raise SystemExit(f"no fused CPU kernels for {isa}")
    rng = np.random.default_rng(0)
    print(f"isa {isa}, {torch.get_num_threads()} threads, CPU {cpu_isa.probe().model}")
    header = f"{'K x N':>12} {'M':>3} {'kind':>7} {'ms/call':>9} {'GB/s':>7} {'GMAC/s':>7} "
    header += f"{'vs bf16':>8}"
    print(header)
    for k, n in SHAPES:
        dense = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        packed_bf16 = kernels.pack_bf16_weight(dense)
        q8 = repack(quantize(dense.float().numpy(), T.Q8_0), T.Q8_0)
        q4k = repack(_q4_k_blocks(n, k, rng), T.Q4_K)
        for m in batches:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            base = _time(lambda: kernels.bf16_linear(x, packed_bf16, n), seconds)  # noqa: B023
            rows = [("bf16", base, n * k * 2)]
            for name, w in (("Q8_0", q8), ("Q4_K", q4k)):
                linear = PackedLinear(w, None, kernels)
                rows.append((name, _time(lambda: linear(x), seconds), w.num_bytes))  # noqa: B023
                int8 = PackedLinear(w, None, kernels, is_int8_activations=True)
                if int8.is_int8:
                    seconds_i8 = _time(lambda: int8(x), seconds)  # noqa: B023
                    rows.append((f"{name}i8", seconds_i8, w.num_bytes))
            for name, sec, num_bytes in rows:
                ratio = base / sec
                print(
                    f"{k:>5} x {n:<5} {m:>3} {name:>7} {sec * 1e3:>9.3f} "
                    f"{num_bytes / sec / 1e9:>7.2f} {m * n * k / sec / 1e9:>7.1f} {ratio:>7.2f}x"
                )


def main() -> None:
    """Parse the options and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default=cpu_isa.resolve().level)
    parser.add_argument("--seconds", type=float, default=0.3, help="timing budget per row")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="rows M")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args.isa, args.seconds, tuple(args.batches))


if __name__ == "__main__":
    main()
