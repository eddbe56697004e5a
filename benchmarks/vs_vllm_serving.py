"""The serving side of ``benchmarks.vs_vllm``: our deployment and ``vllm serve``, one at a
time, each measured by ``vllm bench serve`` and/or ``benchmarks.serving`` at every rate (see
``benchmarks.vs_vllm``'s docstring)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import (
    load_average,
    wait_for_quiet_machine,
)
from benchmarks.vllm_peer import (
    REPO_ROOT,
    cell,
    port_is_free,
    ratio,
    run_logged,
    running_server,
    vllm_command,
    vllm_dtype,
)


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
    health = f"http://127.0.0.1:{args.vllm_port}/health"
    with running_server(vllm_command(args.vllm_venv, serve), work / "vllm_serve.log", health, 900):
        yield f"http://127.0.0.1:{args.vllm_port}"


@dataclass(frozen=True)
class ClientRun:
    """One client run against one server: where, how fast, how much, and where its log goes."""

    base: str
    rate: float
    num_prompts: int
    output_len: int
    log: Path
    seed: int  # draws the prompts (vllm client) or the arrival times (ours)
    max_concurrency: int | None = None  # vllm client: requests in flight at most


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
    if run.max_concurrency is not None:
        bench += ["--max-concurrency", str(run.max_concurrency)]
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
