"""Ours vs vLLM-CPU in one invocation, same machine, same workload; prints the ratios.

vLLM runs from a venv of its own (``benchmarks/peers/setup_vllm_cpu.sh``; never a project
dependency): every vLLM step is a subprocess under that venv's python, with the environment of
``benchmarks/peers/vllm_env.sh`` (the ``vllm`` dist-info shim, ``VLLM_CPU_OMP_THREADS_BIND``,
``VLLM_CPU_KVCACHE_SPACE``). Only one side runs at a time, each in a fresh process, so neither
takes cores or memory from the other.

``offline``: the workloads of ``benchmarks/workloads.py`` (``uniform``, ``mixed``), our engine
through ``benchmarks/throughput.py --skip-transformers`` against vLLM's ``LLM.generate``
(``benchmarks/peers/vllm_offline.py``), fed the same token ids, greedy, ``ignore_eos``, the
same budgets, same dtype, 2 threads each; the sides alternate (ours first in even repeats,
vLLM first in odd ones). Ratio = ours / vLLM tokens/s (> 1: we are faster)::

    .venv/bin/python -m benchmarks.vs_vllm offline --workload uniform mixed --repeats 2 \\
        --wait-for-load 0.5 --json benchmarks/results/vs_vllm_offline.json

``serving``: our deployment (gateway + CB server from a one-app deployment file on ports of its
own, started with ``start_app.py``) and ``vllm serve`` (bf16, served under our model name), one
at a time; against each, ``vllm bench serve`` (vLLM's own client: random dataset, 100 in / 128
out, ``ignore_eos``) and/or our ``benchmarks/serving.py`` at every rate. Ratios are ours / vLLM
(latency: < 1 means we are faster; throughput: > 1 means we are faster)::

    .venv/bin/python -m benchmarks.vs_vllm serving --rates 1 2 4 inf --num-prompts 64 \\
        --wait-for-load 0.5 --json benchmarks/results/vs_vllm_serving.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import (
    load_average,
    run_environment,
    wait_for_quiet_machine,
    write_json,
)
from benchmarks.vllm_peer import (
    DEFAULT_VLLM_VENV,
    PEERS,
    REPO_ROOT,
    SIDES,
    WARMUP_MESSAGES,
    cell,
    median,
    ratio,
    run_logged,
    stand_in_environment,
    vllm_command,
    vllm_dtype,
    vllm_environment,
)
from benchmarks.vs_vllm_serving import CLIENTS, serving
from benchmarks.workloads import WORKLOADS


def vllm_spec(args: argparse.Namespace, workload: str, model: Path) -> dict[str, Any]:
    """The input of ``vllm_offline.py``: the workload as token ids, built by our own workload
    code and tokenizer, so vLLM gets exactly the prompts and budgets our engine gets."""
    from transformers import AutoTokenizer  # slow import: only for the offline comparison

    from benchmarks.workloads import build_workload, render_chat

    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = build_workload(workload, tokenizer, args.num_prompts, args.max_new_tokens)
    return {
        "model": str(model),
        "dtype": vllm_dtype(args),
        "warmup_prompt_token_ids": render_chat(tokenizer, WARMUP_MESSAGES),
        "requests": [
            {"prompt_token_ids": r.prompt_token_ids, "max_new_tokens": r.max_new_tokens}
            for r in requests
        ],
        "llm_kwargs": json.loads(args.vllm_llm_kwargs),
    }


def run_ours_offline(args: argparse.Namespace, workload: str, model: Path, work: Path) -> dict:
    """One run of our engine (``throughput.py``, engine side only) in a fresh process."""
    out = work / f"ours_{workload}_{time.time_ns()}.json"
    cmd = [sys.executable, "-m", "benchmarks.throughput", "--skip-transformers"]
    cmd += ["--workload", workload, "--dtype", args.dtype, "--model", str(model)]
    cmd += ["--num-threads", str(args.num_threads), "--json", str(out)]
    if args.num_prompts is not None:
        cmd += ["--num-prompts", str(args.num_prompts)]
    if args.max_new_tokens is not None:
        cmd += ["--max-new-tokens", str(args.max_new_tokens)]
    run_logged(cmd, out.with_suffix(".log"), args.timeout)
    got = json.loads(out.read_text())
    return {
        "tokens_per_s": got["engine_tokens_per_s"],
        "seconds": got["engine_seconds"],
        "output_tokens": got["engine_output_tokens"],
        "cores_busy": got["engine_cores_busy"],
        "engine_source_sha1": got["engine_source_sha1"],
    }


def run_vllm_offline(args: argparse.Namespace, workload: str, spec_file: Path, work: Path) -> dict:
    """One run of vLLM's ``LLM.generate`` (``vllm_offline.py``) in a fresh process."""
    out = work / f"vllm_{workload}_{time.time_ns()}.json"
    worker = [str(args.vllm_venv / "bin" / "python"), str(PEERS / "vllm_offline.py")]
    worker += ["--input", str(spec_file), "--output", str(out)]
    env_cmd = vllm_command(args.vllm_venv, worker)
    run_logged(env_cmd, out.with_suffix(".log"), args.timeout)
    return json.loads(out.read_text())


def offline(args: argparse.Namespace) -> dict[str, Any]:
    """Alternate both sides on every workload; print and return the runs and the ratios."""
    from tools.prepare_model import ensure_default_model

    model = ensure_default_model(args.model)
    work = Path(tempfile.mkdtemp(prefix="vs_vllm_offline_"))
    result: dict[str, Any] = {"mode": "offline", "dtype": args.dtype, "work_dir": str(work)}
    result["vllm_dtype"] = vllm_dtype(args)
    result |= {"num_threads": args.num_threads, "repeats": args.repeats, "workloads": {}}
    for workload in args.workload:
        spec = vllm_spec(args, workload, model)
        spec_file = work / f"spec_{workload}.json"
        spec_file.write_text(json.dumps(spec))
        runs: list[dict[str, Any]] = []
        for repeat in range(args.repeats):
            # Alternate who goes first: a machine that gets busier or quieter during the run
            # then favours neither side.
            for side in args.sides if repeat % 2 == 0 else args.sides[::-1]:
                waited = wait_for_quiet_machine(args.wait_for_load)
                load = load_average()
                if side == "ours":
                    run = run_ours_offline(args, workload, model, work)
                else:
                    run = run_vllm_offline(args, workload, spec_file, work)
                runs.append({"side": side, "repeat": repeat, "load_average_at_start": load,
                             "waited_for_load_seconds": waited, **run})  # fmt: skip
                print(f"{workload} repeat {repeat} {side}: {run['tokens_per_s']} tok/s "
                      f"({run['cores_busy']} cores busy, load {load})", flush=True)  # fmt: skip
        tok_s = {s: [r["tokens_per_s"] for r in runs if r["side"] == s] for s in SIDES}
        pairs = [ratio(o, v) for o, v in zip(tok_s["ours"], tok_s["vllm"], strict=False)]
        result["workloads"][workload] = {
            "num_requests": len(spec["requests"]),
            "num_output_tokens": sum(r["max_new_tokens"] for r in spec["requests"]),
            "ours_tokens_per_s": tok_s["ours"],
            "vllm_tokens_per_s": tok_s["vllm"],
            "ours_median": median(tok_s["ours"]),
            "vllm_median": median(tok_s["vllm"]),
            "ratio_of_medians": ratio(median(tok_s["ours"]), median(tok_s["vllm"])),
            "ratio_per_repeat": pairs,
            "runs": runs,
        }
    print_offline(result)
    return result


def print_offline(result: dict[str, Any]) -> None:
    """One row per workload: every run's tok/s per side, the medians and ours / vLLM."""
    dtypes = f"ours {result['dtype']}, vLLM {result.get('vllm_dtype', result['dtype'])}"
    print(f"\noffline, {dtypes}, {result['num_threads']} threads; ratio = ours / vLLM")
    print(f"{'workload':<10}{'requests':>9}{'tokens':>8}  {'ours tok/s':<22}{'vLLM tok/s':<22}"
          f"{'ours med':>9}{'vLLM med':>9}{'ratio':>7}  per repeat")  # fmt: skip
    for name, w in result["workloads"].items():
        ours = ", ".join(f"{x:.0f}" for x in w["ours_tokens_per_s"])
        theirs = ", ".join(f"{x:.0f}" for x in w["vllm_tokens_per_s"])
        medians = cell(w["ours_median"], 9, ".1f") + cell(w["vllm_median"], 9, ".1f")
        print(f"{name:<10}{w['num_requests']:>9}{w['num_output_tokens']:>8}  {ours:<22}"
              f"{theirs:<22}{medians}{cell(w['ratio_of_medians'], 6, '.2f')}"
              f"{'x' if w['ratio_of_medians'] is not None else ' '}  "
              f"{w['ratio_per_repeat']}")  # fmt: skip


# --- serving -----------------------------------------------------------------------------------


@contextlib.contextmanager
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see ``--help`` of each mode)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    modes = p.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    venv_help = f"venv of setup_vllm_cpu.sh (default {DEFAULT_VLLM_VENV})"
    common.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV, help=venv_help)
    common.add_argument("--model", type=Path, help="HF model folder (default: SmolLM2)")
    common.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="our dtype, and vLLM's unless --vllm-dtype (bfloat16)",
    )
    common.add_argument(
        "--vllm-dtype",
        choices=("bfloat16", "float32"),
        help="vLLM's dtype, to give it its best on this CPU: on an AVX2-only "
        "CPU vLLM's bfloat16 is several times slower than its float32",
    )
    common.add_argument(
        "--stand-in-isa",
        choices=("avx2",),
        help="both sides as on a CPU of this ISA: ours forced to it (LLM_SUITE_CPU_ISA), "
        "torch and oneDNN capped (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), vLLM made to load "
        "its own build for it (peers/stand_in_avx2)",
    )
    common.add_argument("--json", type=Path, help="write the result as JSON here")
    common.add_argument("--timeout", type=float, default=1800.0, help="seconds per run (1800)")
    load_help = "before each run, wait (<= 10 min) until the 1-minute load average is < LOAD"
    common.add_argument("--wait-for-load", type=float, metavar="LOAD", help=load_help)

    off = modes.add_parser("offline", parents=[common], help="LLM.generate vs our engine")
    off.add_argument("--workload", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    off.add_argument("--repeats", type=int, default=2, help="runs per side (alternating; 2)")
    off.add_argument("--num-threads", type=int, default=2,
                     help="our torch threads (vLLM's: VLLM_CPU_OMP_THREADS_BIND, 0-1)")  # fmt: skip
    off.add_argument("--num-prompts", type=int, help="only the first N requests (quick runs)")
    off.add_argument("--max-new-tokens", type=int, help="cap every budget (quick runs)")
    off.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES),
                     help="which sides, in this order (reversed in odd repeats)")  # fmt: skip
    off.add_argument("--vllm-llm-kwargs", default="{}", help="JSON of extra LLM(...) arguments")
    off.set_defaults(func=offline)

    srv = modes.add_parser("serving", parents=[common], help="vllm serve vs our deployment")
    srv.add_argument("--rates", nargs="+", type=float, default=[1.0, 2.0, 4.0, math.inf])
    srv.add_argument("--num-prompts", type=int, default=64, help="requests per run (64)")
    srv.add_argument("--input-len", type=int, default=100, help="vllm bench: prompt tokens (100)")
    srv.add_argument("--output-len", type=int, default=128, help="output tokens (128)")
    client_help = "vllm: vllm bench serve (default); ours: benchmarks/serving.py; or both"
    srv.add_argument("--client", nargs="+", choices=sorted(CLIENTS), default=["vllm"],
                     help=client_help)  # fmt: skip
    srv.add_argument("--servers", nargs="+", choices=SIDES, default=list(SIDES),
                     help="which servers, in this order (reversed in odd rounds)")  # fmt: skip
    srv.add_argument("--rounds", type=int, default=1, help="times to measure both (1)")
    via_help = "measure through our gateway (default) or the CB server itself"
    srv.add_argument("--ours-via", choices=("gateway", "server"), default="gateway", help=via_help)
    cb_config = REPO_ROOT / "configs" / "cb_server_config.json"
    srv.add_argument("--cb-config", type=Path, default=cb_config, help="our CB server's config")
    srv.add_argument("--model-name", default="SmolLM2-135M-Instruct", help="served model name")
    srv.add_argument("--gateway-port", type=int, default=18200)
    srv.add_argument("--cb-port", type=int, default=18201)
    srv.add_argument("--vllm-port", type=int, default=18300)
    srv.add_argument("--vllm-serve-args", default="", help="extra `vllm serve` arguments")
    srv.set_defaults(func=serving)
    args = p.parse_args(argv)
    if not (args.vllm_venv / "bin" / "python").exists():
        p.error(f"no vLLM venv at {args.vllm_venv}: run benchmarks/peers/setup_vllm_cpu.sh first")
    args.vllm_venv = args.vllm_venv.resolve()
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the chosen comparison; print its table, write the JSON if asked; return it."""
    args = parse_args(argv)
    if args.stand_in_isa:
        os.environ.update(stand_in_environment(args.stand_in_isa))
    start_load = load_average()
    result = args.func(args) | {"load_average_at_start": start_load, **run_environment()}
    result["vllm_environment"] = vllm_environment(args.vllm_venv)
    result["stand_in_isa"] = args.stand_in_isa
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
