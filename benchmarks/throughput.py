"""Offline throughput: the CB engine vs transformers static batching, same weights and dtype.

Both sides run the same fixed workload (see ``benchmarks/workloads.py``) in one process, after
one short untimed warm-up each. transformers runs one left-padded ``generate`` per batch of 32
requests (in workload order) for the batch's largest budget, so the rows that need fewer tokens
produce padding; its tokens/s counts only *useful* tokens (each request's own budget). The
engine gets every request at once and is stepped until all are done. Example::

    .venv/bin/python -m benchmarks.throughput --workload uniform --dtype bfloat16 \\
        --json benchmarks/results/throughput_uniform_bfloat16.json \\
        --plot benchmarks/results/throughput_uniform_bfloat16.png --wait-for-load 0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from benchmarks import (
    load_average,
    run_environment,
    save_figure,
    timed,
    wait_for_quiet_machine,
    write_json,
)
from benchmarks.workloads import WORKLOADS, Request, build_workload, render_chat
from protocol.generation import GenerationConfig
from server.common.backend import SequenceRequest
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.engine_config import EngineConfig
from server.continuous_batching.runner import model_runner
from server.continuous_batching.scheduling.scheduler import SchedulerOutput
from tools.prepare_model import ensure_default_model

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
#: Keys of one side, ``null`` in the JSON when that side is skipped.
OPTIONAL_KEYS = ("engine_tokens_per_s", "engine_seconds", "engine_stats")
OPTIONAL_KEYS += ("transformers_tokens_per_s", "transformers_seconds", "transformers_padding_waste")
#: Parts of the runner's ``execute`` timed on their own (the rest is Python and block copies).
EXECUTE_PARTS = ("metadata", "forward", "logits")
OnCall = Callable[[Any, float], None]
WARMUP_MESSAGES = [{"role": "user", "content": "Say hello to the benchmark."}]


class EngineProfiler:
    """Wall time spent in the engine's parts, by wrapping its methods (the engine is untouched).

    ``schedule`` covers ``Scheduler.schedule`` + ``on_step_done``, ``execute`` the runner's step
    (split into attention ``metadata``, model ``forward``, ``logits`` and the rest: token lists,
    block copies), ``decode`` the decoder (token choice, stop rules, detokenization); the rest of
    ``step`` is ``other``. Each ``execute`` is also timed: decode-only steps per batch size,
    steps with prefill tokens together. ``close()`` removes the wrappers.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = dict.fromkeys(("schedule", "execute", "decode"), 0.0)
        self.seconds |= dict.fromkeys(EXECUTE_PARTS, 0.0)
        self.decode_steps: dict[int, list[float]] = {}
        self.prefill = {"steps": 0, "tokens": 0, "seconds": 0.0}
        self._undo: list[Callable[[], None]] = []
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.scheduler, "on_step_done", "schedule")
        for name in ("launch", "collect", "finish_text"):
            self._wrap(engine.decoder, name, "decode")
        self._wrap(engine.runner, "execute", "execute", self._on_execute)
        self._wrap(model_runner, "plan_attention", "metadata")
        self._wrap(engine.runner.model, "forward", "forward")
        self._wrap(engine.runner.model, "compute_logits", "logits")

    def _wrap(self, obj: object, name: str, key: str, on_call: OnCall | None = None) -> None:
        inner: Callable[..., Any] = getattr(obj, name)
        had_own = name in vars(obj)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            elapsed = time.perf_counter() - start
            self.seconds[key] += elapsed
            if on_call is not None:
                on_call(args[0], elapsed)
            return result

        setattr(obj, name, timed)
        self._undo.append(lambda: setattr(obj, name, inner) if had_own else delattr(obj, name))

    def _on_execute(self, plan: SchedulerOutput, seconds: float) -> None:
        query_tokens = [item.num_query_tokens for item in plan.scheduled]
        if all(n == 1 for n in query_tokens):
            self.decode_steps.setdefault(len(query_tokens), []).append(seconds)
        else:
            self.prefill["steps"] += 1
            self.prefill["tokens"] += sum(query_tokens)
            self.prefill["seconds"] += seconds

    def close(self) -> None:
        """Put the engine's own methods back."""
        for undo in reversed(self._undo):
            undo()

    def summary(self, total_seconds: float) -> dict[str, Any]:
        """Seconds per part, prefill steps, and median ms of a decode step per batch size."""
        inner = {k: round(self.seconds[k], 4) for k in EXECUTE_PARTS}
        inner["rest"] = round(self.seconds["execute"] - sum(inner.values()), 4)
        split = {k: round(self.seconds[k], 4) for k in ("schedule", "execute", "decode")}
        split["other"] = round(total_seconds - sum(split.values()), 4)
        decode_ms = {
            str(size): {"median_ms": round(statistics.median(t) * 1e3, 2), "steps": len(t)}
            for size, t in sorted(self.decode_steps.items())
        }
        return {
            "time_split_seconds": split,
            "execute_split_seconds": inner,
            "steps_with_prefill": {**self.prefill, "seconds": round(self.prefill["seconds"], 4)},
            "decode_step_ms_by_batch": decode_ms,
        }


def engine_config(args: argparse.Namespace, model: Path) -> EngineConfig:
    """The engine configuration of the benchmark (the values of the issue)."""
    loading = {"model_name_or_path": str(model), "torch_dtype": args.dtype}
    cache = {"num_blocks": None, "memory_budget_gb": 2, "num_blocks_cpu": 64, "block_size": 16}
    return EngineConfig.model_validate(
        {
            "model_loading_config": {**loading, "num_threads": args.num_threads},
            "batcher_config": {"batch_max_tokens": args.batch_max_tokens, "batch_max_beams": 64},
            "cache_config": cache,
        }
    )


def run_engine(
    engine: LLMEngine,
    requests: list[Request],
    tag: str,
    options: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Add every request (with the extra ``generation_config`` ``options``), step until all
    finish; generated tokens per request id."""
    counts: dict[str, int] = {}
    for i, request in enumerate(requests):
        config = GenerationConfig(
            max_new_tokens=request.max_new_tokens, ignore_eos=True, **(options or {})
        )
        engine.add_request(SequenceRequest(f"{tag}-{i}", request.prompt_token_ids, config))
        counts[f"{tag}-{i}"] = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            counts[output.request_id] += sum(d.num_new_tokens for d in output.deltas)
    return counts


def run_transformers(
    model: Any, tokenizer: Any, requests: list[Request], batch_size: int
) -> tuple[int, int]:
    """Static batching: one left-padded greedy ``generate`` per batch, for the batch's largest
    budget (``min_new_tokens`` = ``max_new_tokens``, so no row stops early). Returns (useful,
    computed) output tokens; computed includes the rows' padding past their own budget."""
    useful = computed = 0
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        budget = max(r.max_new_tokens for r in batch)
        encoded = tokenizer.pad(
            {"input_ids": [r.prompt_token_ids for r in batch]}, padding=True, return_tensors="pt"
        )
        output = model.generate(
            input_ids=encoded["input_ids"],
            attention_mask=encoded["attention_mask"],
            max_new_tokens=budget,
            min_new_tokens=budget,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        new_tokens = output.shape[1] - encoded["input_ids"].shape[1]
        assert new_tokens == budget, f"transformers made {new_tokens} tokens, not {budget}"
        useful += sum(r.max_new_tokens for r in batch)
        computed += budget * len(batch)
    return useful, computed


def engine_source_digest() -> str:
    """SHA-1 of the engine's source files: which engine version a result belongs to."""
    digest = hashlib.sha1()
    for path in sorted((REPO_ROOT / "server" / "continuous_batching").rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def bench_engine(args: argparse.Namespace, model: Path, requests: list[Request]) -> dict:
    """Load the engine, warm it up, run the workload; its part of the result."""
    engine = LLMEngine(engine_config(args, model))
    warm = [Request(render_chat(engine.tokenizer, WARMUP_MESSAGES), 4)] * 2
    run_engine(engine, warm, "warm", args.generation_config)
    before = dataclasses.asdict(engine.stats)
    profiler = EngineProfiler(engine)
    options = args.generation_config
    counts, seconds, cores = timed(lambda: run_engine(engine, requests, "bench", options))
    profiler.close()
    for i, request in enumerate(requests):
        got = counts[f"bench-{i}"]
        assert got == request.max_new_tokens, f"request {i}: {got} != {request.max_new_tokens}"
    stats = {k: v - before[k] for k, v in dataclasses.asdict(engine.stats).items()}
    tokens = sum(counts.values())
    return {
        "engine_tokens_per_s": round(tokens / seconds, 2),
        "engine_seconds": round(seconds, 3),
        "engine_output_tokens": tokens,
        "engine_cores_busy": cores,
        "engine_stats": stats,
        "engine_profile": profiler.summary(seconds),
        "engine_config": engine.config.model_dump(),
        "engine_generation_config": args.generation_config,
        # Which CPU path ran (ISA level, kernels, torch's own dispatch): levels can be forced.
        "engine_compute_path": engine.runner.compute_path.model_dump(),
    }


def bench_transformers(
    args: argparse.Namespace, model_path: Path, tokenizer: Any, requests: list[Request]
) -> dict:
    """Load the transformers model, warm it up, run static batching; its part of the result."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[args.dtype])
    model.eval()
    with torch.inference_mode():
        warm = [Request(render_chat(tokenizer, WARMUP_MESSAGES), 4)] * 2
        run_transformers(model, tokenizer, warm, args.batch_size)
        run = lambda: run_transformers(model, tokenizer, requests, args.batch_size)  # noqa: E731
        (useful, computed), seconds, cores = timed(run)
    return {
        "transformers_tokens_per_s": round(useful / seconds, 2),
        "transformers_seconds": round(seconds, 3),
        "transformers_output_tokens": useful,
        "transformers_computed_tokens": computed,
        "transformers_raw_tokens_per_s": round(computed / seconds, 2),
        "transformers_padding_waste": round(1 - useful / computed, 4),
        "transformers_cores_busy": cores,
        "transformers_batch_size": args.batch_size,
    }


def print_table(result: dict[str, Any]) -> None:
    """A side-by-side table of both sides."""
    print(f"\n{result['workload']}, {result['dtype']}, {result['num_threads']} threads")
    print(f"{'side':<14}{'requests':>9}{'out tokens':>11}{'seconds':>9}{'tokens/s':>9}{'ratio':>7}")
    for side, ratio in (("transformers", 1.0), ("engine", result["ratio"])):
        if result.get(f"{side}_seconds") is not None:
            cells = [
                result[f"{side}_{key}"] for key in ("output_tokens", "seconds", "tokens_per_s")
            ]
            ratio_cell = f"{ratio:>7.2f}" if ratio is not None else ""
            print(f"{side:<14}{result['num_requests']:>9}{cells[0]:>11}{cells[1]:>9.2f}"
                  f"{cells[2]:>9.1f}{ratio_cell}")  # fmt: skip
    if result.get("transformers_padding_waste") is not None:
        print(f"transformers padding waste: {result['transformers_padding_waste']:.1%}")
    for key in ("time_split_seconds", "execute_split_seconds", "steps_with_prefill"):
        if "engine_profile" in result:
            print(f"engine {key}: {result['engine_profile'][key]}")


def plot(result: dict[str, Any], path: Path) -> None:
    """Bar plot of tokens/s per side, plus the engine's time split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    bars = {  # label -> (tokens/s, colour); raw transformers counts its padding too
        "transformers\n(incl. padding)": (result.get("transformers_raw_tokens_per_s"), "silver"),
        "transformers": (result.get("transformers_tokens_per_s"), "tab:gray"),
        "engine": (result.get("engine_tokens_per_s"), "tab:blue"),
    }
    if not result.get("transformers_padding_waste"):
        bars.pop("transformers\n(incl. padding)")
    bars = {k: v for k, v in bars.items() if v[0] is not None}
    drawn = left.bar(list(bars), [v[0] for v in bars.values()], color=[c for _, c in bars.values()])
    left.bar_label(drawn, fmt="%.0f")
    left.set_ylabel("output tokens/s")
    ratio = result.get("ratio")
    title = f"{result['workload']}, {result['dtype']}"
    left.set_title(title + (f": {ratio:.2f}x" if ratio else ""))
    profile = result.get("engine_profile") or {}
    split = dict(profile.get("time_split_seconds", {}))
    if split:  # show the runner's parts in place of its total
        split.pop("execute")
        split |= {f"execute: {k}": v for k, v in profile["execute_split_seconds"].items()}
    right.barh(list(split), list(split.values()), color="tab:blue")
    right.set_xlabel("seconds")
    right.set_title("engine time split")
    save_figure(fig, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=WORKLOADS, default="uniform", help="prompt set")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="both sides")
    p.add_argument("--json", type=Path, help="write the result as JSON here")
    p.add_argument("--plot", type=Path, help="write a bar plot (PNG) here")
    p.add_argument("--num-threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--model", type=Path, help="HF model folder (default: the SmolLM2 model)")
    p.add_argument("--skip-transformers", action="store_true", help="run the engine only")
    p.add_argument("--skip-engine", action="store_true", help="run transformers only")
    p.add_argument("--num-prompts", type=int, help="use only the first N requests")
    p.add_argument("--max-new-tokens", type=int, help="cap every request's budget")
    p.add_argument("--batch-size", type=int, default=32, help="transformers batch (default 32)")
    p.add_argument("--batch-max-tokens", type=int, default=1024, help="engine tokens per step")
    p.add_argument("--generation-config", type=json.loads, default={}, metavar="JSON",
                   help="extra generation_config fields for every engine request (the cost "
                   "of a knob), e.g. '{\"frequency_penalty\": 0.5}'")  # fmt: skip
    p.add_argument("--wait-for-load", type=float, metavar="LOAD", help="first wait (<= 10 min) "
                   "until the 1-minute load average is below LOAD")  # fmt: skip
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table, write JSON/plot if asked; return the result."""
    args = parse_args(argv)
    torch.set_num_threads(args.num_threads)
    model = ensure_default_model(args.model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model, padding_side="left")
    requests = build_workload(args.workload, tokenizer, args.num_prompts, args.max_new_tokens)
    lens = [len(r.prompt_token_ids) for r in requests]
    waited = wait_for_quiet_machine(args.wait_for_load)
    result: dict[str, Any] = {
        "workload": args.workload,
        "dtype": args.dtype,
        "num_threads": args.num_threads,
        "num_requests": len(requests),
        "num_output_tokens": sum(r.max_new_tokens for r in requests),
        "prompt_tokens": {"total": sum(lens), "min": min(lens), "max": max(lens)},
        "model": str(model),
        "engine_source_sha1": engine_source_digest(),  # as imported at start-up
        "load_average_at_start": load_average(),
        "waited_for_load_seconds": waited,
    }
    if not args.skip_transformers:
        result.update(bench_transformers(args, model, tokenizer, requests))
    if not args.skip_engine:
        result.update(bench_engine(args, model, requests))
    both = not (args.skip_engine or args.skip_transformers)
    ratio = result["engine_tokens_per_s"] / result["transformers_tokens_per_s"] if both else None
    result.update(
        ratio=round(ratio, 3) if ratio is not None else None,
        **{key: result.get(key) for key in OPTIONAL_KEYS},
        **run_environment(),
    )
    print_table(result)
    if args.json:
        write_json(result, args.json)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
