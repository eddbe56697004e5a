"""Micro-benchmark: the fused CPU kernels' matmul and attention against what they replace.

Run by hand (not a test), on a quiet machine:

    .venv/bin/python -m benchmarks.bench_cpu_kernels [--model models/SmolLM2-135M-Instruct]
        [--rows 1 32 64 256] [--rounds 7] [--threads 2] [--isa avx2]

``--isa`` picks the kernels' ISA level (default: this CPU's best; a lower one is forced, see
``cpu_isa``). To measure as on a CPU of that level, cap torch and oneDNN too:
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ... --isa avx2``.

* **linear**: ``bf16_linear`` (the extension's matmul at that level, weights packed once)
  against oneDNN's prepacked matmul (``torch.ops.mkldnn._linear_pointwise``) in bfloat16 where
  oneDNN runs bf16 on this CPU, and in float32 (what a float32 config reads: twice the bytes)
  for the model's four layer shapes and its lm_head. Each layer shape cycles through one weight
  per layer (as many as the model has), so weights come from memory as in a real step, not
  from a warm cache.
* **attention**: ``PagedAttention`` on the ``cpu`` backend (the kernel) against the torch path
  (the reference), bfloat16, one cache per layer: decode steps of 32 sequences, a prefill of
  ten 100-token prompts after a 30-token cached prefix, and one 1,000-token prompt.

Each case alternates the two sides every round and prints median milliseconds and the speed-up
(> 1: the kernel is faster). Needs the kernels built (``make kernels``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.bench_model_step import BLOCK_SIZE, time_interleaved
from server.continuous_batching.model import build_attention_metadata, cpu_isa, cpu_kernels
from server.continuous_batching.model.paged_attention import PagedAttention

REPO_ROOT = Path(__file__).resolve().parents[1]


def median_ms(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median wall time (ms) of each function, alternating between them every round."""
    return {name: statistics.median(t) for name, t in time_interleaved(fns, rounds).items()}


def bench_linear(kernels, config: dict, rows: list[int], rounds: int, onednn_bf16: bool) -> None:
    """bf16_linear vs oneDNN prepacked, per layer shape; each call cycles over the layers."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    num_layers = config["num_hidden_layers"]
    shapes = {
        "qkv": (hidden, (heads + 2 * kv_heads) * head_dim, num_layers),
        "o_proj": (heads * head_dim, hidden, num_layers),
        "gate_up": (hidden, 2 * inter, num_layers),
        "down": (inter, hidden, num_layers),
        "lm_head": (hidden, config["vocab_size"], 1),
    }
    baselines = ["onednn_fp32"] + (["onednn_bf16"] if onednn_bf16 else [])
    print(f"\nlinear (ms per call; {num_layers} weights per layer shape; speed-up of ours)")
    header = "".join(f"{b:>12s}" for b in baselines)
    print(f"{'shape':8s} {'K':>5s} {'N':>6s} {'rows':>5s}{header} {'ours':>8s}  speed-ups")
    for name, (k, n, count) in shapes.items():
        weights = [torch.randn(n, k).bfloat16() for _ in range(count)]
        packed = {"ours": [kernels.pack_bf16_weight(w) for w in weights]}
        packed["onednn_fp32"] = [
            torch.ops.mkldnn._reorder_linear_weight(w.float(), 32) for w in weights
        ]
        if onednn_bf16:
            packed["onednn_bf16"] = [
                torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights
            ]
        del weights
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            inputs = {"ours": x, "onednn_fp32": x.float(), "onednn_bf16": x}

            def run_ours(x: torch.Tensor = x, weights: list = packed["ours"], n: int = n) -> None:
                for w in weights:
                    kernels.bf16_linear(x, w, n)

            def run_onednn(x: torch.Tensor, weights: list) -> None:
                for w in weights:
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

            fns = {"ours": run_ours} | {
                b: lambda x=inputs[b], w=packed[b]: run_onednn(x, w) for b in baselines
            }
            t = {key: value / count for key, value in median_ms(fns, rounds).items()}
            cells = "".join(f"{t[b]:12.3f}" for b in baselines)
            ups = " ".join(f"{t[b] / t['ours']:6.2f}x" for b in baselines)
            print(f"{name:8s} {k:5d} {n:6d} {m:5d}{cells} {t['ours']:8.3f}  {ups}")


def _caches(num_layers: int, num_blocks: int, kv_heads: int, head_dim: int):
    shape = (num_blocks * BLOCK_SIZE, kv_heads, head_dim)
    return [
        (torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(num_layers)
    ]


def bench_attention(kernels, config: dict, rounds: int) -> None:
    """The cpu backend against the torch path over all layers, decode and prefill shapes."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    num_layers = config["num_hidden_layers"]
    cpu = torch.device("cpu")
    # (label, query lens, context lens)
    cases = [
        ("decode 32 x ctx 160", [1] * 32, [152 + i % 17 for i in range(32)]),
        ("decode 32 x ctx 400", [1] * 32, [392 + i % 17 for i in range(32)]),
        ("prefill 10 x 100 (+30 cached)", [100] * 10, [130] * 10),
        ("prefill 1 x 1000", [1000], [1000]),
    ]
    print(f"\nattention, bfloat16, all {num_layers} layers (ms per step; one cache per layer)")
    print(f"{'case':32s} {'torch':>8s} {'kernel':>8s} {'speed-up':>9s}")
    for label, query_lens, context_lens in cases:
        blocks = [-(-n // BLOCK_SIZE) for n in context_lens]
        order = (torch.randperm(sum(blocks)) + 1).tolist()  # scattered, as in a real pool
        tables, start = [], 0
        for b in blocks:
            tables.append(order[start : start + b])
            start += b
        caches = _caches(num_layers, sum(blocks) + 1, kv_heads, head_dim)
        q = torch.randn(sum(query_lens), heads, head_dim).bfloat16()
        kernel_meta = build_attention_metadata(
            query_lens, context_lens, tables, BLOCK_SIZE, cpu, True, kernel_takes_prefill=True
        )
        torch_meta = build_attention_metadata(query_lens, context_lens, tables, BLOCK_SIZE, cpu)
        kernel = PagedAttention(
            kernel_meta, heads, kv_heads, head_dim, torch.bfloat16, "cpu", 16, kernels
        )
        reference = PagedAttention(torch_meta, heads, kv_heads, head_dim, torch.bfloat16)
        sides = {"torch": reference, "kernel": kernel}
        t = median_ms(
            {
                name: lambda a=attention, q=q, caches=caches: [a(q, k, v) for k, v in caches]
                for name, attention in sides.items()
            },
            rounds,
        )
        print(f"{label:32s} {t['torch']:8.2f} {t['kernel']:8.2f} {t['torch'] / t['kernel']:8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO_ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64, 256])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", choices=cpu_isa.LEVELS[1:], help="kernel level (default: best)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = cpu_isa.resolve(args.isa or "auto")
    kernels = cpu_kernels.load(path.level, verbose=True)
    if kernels is None:
        raise SystemExit(f"the fused CPU kernels ({path.level}) are not available (make kernels)")
    config = json.loads((Path(args.model) / "config.json").read_text())
    print(f"threads={args.threads} model={args.model} isa={path.level} gemm: {kernels.gemm}")
    print(f"torch: {torch.backends.cpu.get_cpu_capability()}; CPU: {path.cpu_model}")
    bench_linear(kernels, config, args.rows, args.rounds, path.can_pack_onednn_bf16())
    bench_attention(kernels, config, args.rounds)


if __name__ == "__main__":
    main()
