"""Memory and decode speed of the GPTQ int4 model against bfloat16.

Run by hand (not a test), on a quiet machine:

    .venv/bin/python -m benchmarks.bench_int4 [--batches 1 32] [--context 128] [--steps 10]

No GPTQ checkpoint of the default model exists offline, so the script first writes one into
``--gptq-dir`` (round-to-nearest asymmetric 4-bit, group 64, v1 format: the numbers measured
here do not depend on how the codes were chosen). Then each variant runs in a fresh
subprocess, so its memory is its own:

* ``bf16``: the dense bfloat16 model from the safetensors folder;
* ``int4``: the GPTQ folder, weights kept at 4 bits (bf16 compute): torch's CPU int4 kernel;
* ``int4-portable``: the same with that kernel switched off (unpack, scale, dense matmul);
* ``int4-dequant``: the GPTQ folder dequantised to bfloat16 at load (dense path).

Columns: weight bytes (parameters + int4 buffers + CPU-prepacked matmul copies), resident
memory growth while loading (``RSS``), decode tokens/s (one step for ``batch`` sequences at
~``context`` tokens of random KV, median of ``--steps``, as in ``bench_model_step``) and
prefill tokens/s (one forward over a ``--prefill``-token prompt).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.bench_model_step import BLOCK_SIZE, ours_step, time_interleaved
from harness.gptq_writer import pack_rows
from server.continuous_batching.engine_config import ModelLoadingConfig
from server.continuous_batching.model import (
    LlamaForCausalLM,
    build_attention_metadata,
    kv_cache_shape,
)
from server.continuous_batching.model.linear import Linear
from server.continuous_batching.model.weights import load_model
from server.continuous_batching.quantization import quant_linear

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VARIANTS = ("bf16", "int4", "int4-portable", "int4-dequant")


def write_gptq(model_dir: Path, out_dir: Path, group_size: int) -> None:
    """Quantise the model's linear layers (RTN, asymmetric, per group) into a GPTQ v1 folder."""
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in load_file(str(model_dir / "model.safetensors")).items():
        prefix = name.rpartition(".")[0]
        if prefix.rpartition(".")[2] not in LINEARS:
            tensors[name] = weight.half()
            continue
        w = weight.t().float()  # [in, out]
        in_features, out = w.shape
        groups = w.reshape(in_features // group_size, group_size, out)
        xmin = groups.amin(1).clamp(max=0)
        xmax = groups.amax(1).clamp(min=0)
        scales = ((xmax - xmin) / 15).clamp(min=1e-6).half()
        zeros = torch.round(-xmin / scales.float()).clamp(0, 15)
        codes = (torch.round(groups / scales.float()[:, None]) + zeros[:, None]).clamp(0, 15)
        stored_zeros = (zeros.long() - 1) & 15  # the v1 format stores zero - 1
        tensors[f"{prefix}.qweight"] = pack_rows(codes.reshape(in_features, out).long())
        tensors[f"{prefix}.qzeros"] = pack_rows(stored_zeros.t().contiguous()).t().contiguous()
        tensors[f"{prefix}.scales"] = scales
        tensors[f"{prefix}.g_idx"] = (torch.arange(in_features) // group_size).int()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    quant = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False}
    quant |= {"sym": False, "checkpoint_format": "gptq"}
    (out_dir / "quantize_config.json").write_text(json.dumps(quant))
    shutil.copy(model_dir / "config.json", out_dir / "config.json")


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of every weight the model holds: parameters, int4 buffers and the separate
    oneDNN-prepacked copies dense ``Linear``s keep next to their parameters."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    linears = [getattr(layer, n) for layer in model.layers for n in ("qkv", "o_proj", "gate_up")]
    linears += [layer.down for layer in model.layers] + [model.lm_head_linear]
    for linear in linears:
        if isinstance(linear, Linear):
            if linear.is_packed:
                total += linear.weight.numel() * linear.weight.element_size()
        else:
            total += linear.nbytes
    return total


def prefill_step(model: LlamaForCausalLM, tokens: int) -> Callable[[], torch.Tensor]:
    """A closure running one forward over a ``tokens``-long prompt (logits of its last row)."""
    num_blocks = -(-tokens // BLOCK_SIZE)
    shape = kv_cache_shape(model.config, num_blocks + 1, BLOCK_SIZE)
    caches = [
        (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
        for _ in model.layers
    ]
    ids = torch.randint(0, model.config.vocab_size, (tokens,))
    positions = torch.arange(tokens)
    table = list(range(1, num_blocks + 1))

    def step() -> torch.Tensor:
        meta = build_attention_metadata([tokens], [tokens], [table], BLOCK_SIZE, model.device)
        return model.compute_logits(model(ids, positions, caches, meta)[-1:])

    return step


def _rss() -> int:
    """Resident set size of this process in bytes, after handing freed heap memory back to
    the OS (glibc keeps load-time temporaries otherwise, which is allocator noise here)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def run_variant(args: argparse.Namespace) -> dict[str, float]:
    """Load one variant, measure it, return its row (run inside a fresh subprocess)."""
    torch.set_num_threads(args.threads)
    quant_linear.CPU_KERNEL_ENABLED = args.variant != "int4-portable"
    path = args.model if args.variant == "bf16" else args.gptq_dir
    before = _rss()
    loading = ModelLoadingConfig(
        model_name_or_path=str(path),
        torch_dtype="bfloat16",
        gptq_dequantize_at_load=args.variant == "int4-dequant",
    )
    model, _ = load_model(loading)
    row: dict[str, float] = {"weights": weight_bytes(model), "rss": _rss() - before}
    for batch in args.batches:
        times = time_interleaved({"step": ours_step(model, batch, args.context)}, args.steps)
        row[f"tok/s b{batch}"] = batch / statistics.median(times["step"]) * 1e3
    times = time_interleaved({"step": prefill_step(model, args.prefill)}, max(3, args.steps // 3))
    row[f"prefill {args.prefill}"] = args.prefill / statistics.median(times["step"]) * 1e3
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--gptq-dir", type=Path, default=REPO_ROOT / "models" / "gptq-int4-g64")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per batch size")
    parser.add_argument("--prefill", type=int, default=512, help="prompt length for prefill")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # child process: print one JSON row
        print(json.dumps(run_variant(args)))
        return
    if not (args.gptq_dir / "model.safetensors").is_file():
        print(f"writing the int4 checkpoint to {args.gptq_dir} ...", flush=True)
        write_gptq(args.model, args.gptq_dir, args.group_size)
    rows: dict[str, dict[str, float]] = {}
    for variant in args.variants:
        child = [sys.executable, "-m", "benchmarks.bench_int4", "--variant", variant]
        child += sys.argv[1:]
        done = subprocess.run(child, cwd=REPO_ROOT, check=True, capture_output=True, text=True)
        out = done.stdout
        rows[variant] = json.loads(out.strip().splitlines()[-1])
        print(f"{variant}: {rows[variant]}", flush=True)
    speed_cols = [f"tok/s b{b}" for b in args.batches] + [f"prefill {args.prefill}"]
    header = f"| variant       | weights MiB | RSS MiB | {' | '.join(speed_cols)} |"
    print(f"\nthreads={args.threads} context~{args.context} group_size={args.group_size}")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.strip("|").split("|")) + "|")
    for variant, row in rows.items():
        speeds = " | ".join(f"{row[c]:{len(c)}.1f}" for c in speed_cols)
        print(
            f"| {variant:13s} | {row['weights'] / 2**20:11.1f} | {row['rss'] / 2**20:7.1f} "
            f"| {speeds} |"
        )


if __name__ == "__main__":
    main()
