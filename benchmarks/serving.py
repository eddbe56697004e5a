"""Online serving benchmark: Poisson arrivals against any OpenAI-compatible server, streaming.

Sends ``--num-requests`` chat prompts from the fixed set of ``benchmarks/workloads.py`` (the
first 32 are the ``uniform`` workload's) to ``--base-url`` (our gateway, one of our servers or
another engine's server), each launched at its arrival time: gaps drawn by
``random.Random(seed).expovariate(rate)``, first request at t=0; ``--rate inf`` sends all at once.
Every request streams; one chunk at a time is timed as it arrives. Reports throughput and the
mean/p50/p90/p99 of TTFT (time to first non-empty content), TPOT ((e2e - ttft) / (tokens - 1)),
ITL (gap between content chunks) and E2E latency, in ms. Example::

    .venv/bin/python -m benchmarks.serving --base-url http://127.0.0.1:8001/v1 --rate 4 \\
        --ignore-eos --label cb --json benchmarks/results/serving_cb_rate4.json \\
        --plot benchmarks/results/serving_cb_rate4.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import (
    load_average,
    run_environment,
    save_figure,
    wait_for_quiet_machine,
)
from benchmarks.workloads import Messages, chat_messages
from utils.sse import DONE, iter_sse_data

METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestResult:
    """What one request measured (seconds); ``error`` is None when it completed."""

    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for single-token answers)."""
        if self.error or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def load_prompts(tokenizer_path: Path | None, count: int) -> tuple[list[Messages], list[str]]:
    """The first ``count`` chats of the shared prompt set, and each rendered with the chat
    template as text (what ``--endpoint completions`` sends, so both endpoints see one input)."""
    from transformers import AutoTokenizer  # slow import: only when prompts are built

    from tools.prepare_model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model(tokenizer_path))
    chats = chat_messages(tokenizer, count)
    texts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in chats
    ]
    return chats, texts


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent (a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], is_chat: bool, timeout: float
) -> RequestResult:
    """Stream one request and time its content chunks; never raises (errors are recorded)."""
    result, chunks, usage_tokens = RequestResult(), 0, None
    start = last = time.perf_counter()
    try:
        async with asyncio.timeout(timeout), client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for data in iter_sse_data(response.aiter_lines()):
                if data.strip() == DONE:
                    break
                event = json.loads(data)
                if event.get("error"):  # a mid-stream failure: the status line was 200 already
                    result.error = f"error event: {json.dumps(event['error'])[:200]}"
                    return result
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") if is_chat else choice.get("text")
                    if not text:  # role-only and finish-only chunks carry no token
                        continue
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last, chunks = now, chunks + 1
    # ValueError: bad JSON or bytes; AttributeError: an event that is not an object.
    except (httpx.HTTPError, TimeoutError, ValueError, AttributeError) as exc:
        why = f"no answer within {timeout:g} s" if isinstance(exc, TimeoutError) else str(exc)
        result.error = f"{type(exc).__name__}: {why}"[:200]
        return result
    result.e2e = time.perf_counter() - start
    # Several tokens may share a chunk (detokenizers hold back partial characters), so the
    # usage chunk is the truth; counting chunks is the fallback for servers that do not send it.
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    return result


def stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles of ``values`` (seconds) in ms; None everywhere when empty."""
    if not values:
        return dict.fromkeys(("mean", "p50", "p90", "p99"))
    ms = np.asarray(values) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": round(float(ms.mean()), 2)} | {
        name: round(float(v), 2) for name, v in (("p50", p50), ("p90", p90), ("p99", p99))
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Throughput, latency statistics and the per-request records of one run."""
    done = [r for r in results if r.error is None]
    tokens = sum(r.output_tokens for r in done)
    samples = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [x for r in done for x in r.itls],
        "e2e": [r.e2e for r in done if r.e2e is not None],
    }
    return {
        "duration_s": round(duration, 3),
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_output_tokens": tokens,
        "request_throughput": round(len(done) / duration, 3),
        "output_throughput": round(tokens / duration, 2),
        **{f"{name}_ms": stats_ms(samples[name]) for name in METRICS},
        "errors": sorted({r.error for r in results if r.error})[:10],
        "requests": [asdict(r) | {"tpot": r.tpot} for r in results],
    }


async def amain(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The benchmark: parse ``argv``, run, print the table, write JSON/plot; return the result."""
    args = parse_args(argv)
    chats, texts = await asyncio.to_thread(load_prompts, args.tokenizer, args.num_requests)
    waited = await asyncio.to_thread(wait_for_quiet_machine, args.wait_for_load, 300.0)
    base = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=args.num_requests + 1)  # never queue in the pool
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        model = args.model or await first_model(client, base)
        common = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature}
        common |= {"stream": True, "stream_options": {"include_usage": True}}
        if args.ignore_eos:  # a vLLM extra: only sent when asked, strict servers reject it
            common["ignore_eos"] = True
        is_chat = args.endpoint == "chat"
        url = f"{base}/chat/completions" if is_chat else f"{base}/completions"
        prompts = [{"messages": c} for c in chats] if is_chat else [{"prompt": t} for t in texts]
        bodies = [common | prompt for prompt in prompts]
        arrivals = arrival_times(args.num_requests, args.rate, args.seed)
        load_at_start, start, cpu = load_average(), time.perf_counter(), time.process_time()

        async def launch(body: dict[str, Any], at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await send_request(client, url, body, is_chat, args.timeout)

        tasks = [launch(b, at) for b, at in zip(bodies, arrivals, strict=True)]
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        # The client shares the cores with the server it measures: say how much it took.
        client_cores = round((time.process_time() - cpu) / duration, 3)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {"label": args.label, "model": model, "config": config | {"rate": str(args.rate)}}
    result |= {"load_average_at_start": load_at_start, "waited_for_load_seconds": waited}
    result |= {"client_cpu_cores": client_cores, "last_arrival_s": round(arrivals[-1], 3)}
    result |= summarize(results, duration) | run_environment()
    print_table(result)
    if args.json:
        await asyncio.to_thread(write_text, args.json, json.dumps(result, indent=2) + "\n")
    if args.plot:
        await asyncio.to_thread(plot, result, args.plot)
    return result


async def first_model(client: httpx.AsyncClient, base: str) -> str:
    """The first model id of ``GET /v1/models`` (the default ``--model``)."""
    response = await client.get(f"{base}/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def print_table(result: dict[str, Any]) -> None:
    """The human summary: counts and throughput, then one row per latency metric."""
    print(
        f"{result['label'] or result['model']}: rate {result['config']['rate']} req/s, "
        f"{result['completed']} completed, {result['failed']} failed in {result['duration_s']} s, "
        f"{result['request_throughput']} req/s, {result['output_throughput']} output tok/s, "
        f"load {result['load_average_at_start']}"
    )
    print(f"{'ms':<6}" + "".join(f"{k:>10}" for k in ("mean", "p50", "p90", "p99")))
    for name in METRICS:
        row = result[f"{name}_ms"]
        print(f"{name:<6}" + "".join(f"{row[k] if row[k] is not None else '-':>10}" for k in row))
    for error in result["errors"]:
        print(f"error: {error}")


def plot(result: dict[str, Any], path: Path) -> None:
    """CDFs of TTFT and TPOT (ms), one panel each, with the p50/p99 marked."""
    import matplotlib

    matplotlib.use("Agg")  # no display on the benchmark machines
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name in zip(axes, ("ttft", "tpot"), strict=True):
        done = [r for r in result["requests"] if r["error"] is None and r[name] is not None]
        values = sorted(r[name] * 1000 for r in done)
        if values:
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
        for q in ("p50", "p99"):
            if result[f"{name}_ms"][q] is not None:
                ax.axvline(result[f"{name}_ms"][q], ls="--", c="gray", lw=0.8)
        ax.set_xlabel(f"{name.upper()} (ms); dashed: p50, p99")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    title = f"{result['label'] or result['model']}: {result['config']['rate']} req/s, "
    fig.suptitle(title + f"{result['completed']}/{result['config']['num_requests']} completed")
    save_figure(fig, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add = p.add_argument
    add("--base-url", required=True, help="OpenAI base URL, e.g. http://127.0.0.1:8001/v1")
    add("--model", help="model name to send (default: the first of GET <base-url>/models)")
    add("--endpoint", choices=("chat", "completions"), default="chat",
        help="chat (default): messages; completions: the chat-template-rendered text")  # fmt: skip
    add(
        "--rate",
        type=float,
        default=math.inf,
        help="mean req/s, Poisson; inf (default): all at once",
    )
    add("--num-requests", type=int, default=64, help="requests to send (default 64)")
    add("--max-tokens", type=int, default=128, help="max_tokens of each (default 128)")
    add("--ignore-eos", action="store_true", help="send vLLM's extra ignore_eos=true")
    add("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    add("--seed", type=int, default=0, help="seed of the arrival times (default 0)")
    add("--timeout", type=float, default=300.0, help="seconds per request, else failed (300)")
    add("--tokenizer", type=Path, help="HF folder that builds the prompt set (default SmolLM2)")
    add("--wait-for-load", type=float, metavar="LOAD", help="wait (<= 5 min) for load < LOAD")
    add("--label", default="", help="name of this run in the table, JSON and plot")
    add("--json", type=Path, help="write the result as JSON here")
    add("--plot", type=Path, help="write CDF plots of TTFT and TPOT (PNG) here")
    args = p.parse_args(argv)
    if args.rate <= 0 or args.num_requests < 1 or args.max_tokens < 1 or args.timeout <= 0:
        p.error("--rate, --num-requests, --max-tokens and --timeout must be positive")
    return args


if __name__ == "__main__":
    asyncio.run(amain())
