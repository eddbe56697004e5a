"""Benchmarks of the suite (offline throughput, serving) and their shared helpers.

The machine's cores are shared with other work, so a benchmark first waits for a quiet machine,
records the load it ran under and how many cores its timed sections really got.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

# Before any benchmark imports transformers (``python -m benchmarks.X`` runs this first): the
# model is on disk, and the tokenizers' thread pool would fight the engine's for the cores.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

T = TypeVar("T")


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def wait_for_quiet_machine(max_load: float | None, timeout: float = 600.0) -> float:
    """Sleep (60 s at a time) until the 1-minute load average is below ``max_load``, at most
    ``timeout`` seconds; ``None`` does not wait. Returns the seconds waited."""
    start = time.monotonic()
    while max_load is not None and os.getloadavg()[0] >= max_load:
        if time.monotonic() - start > timeout:
            print(f"load still {load_average()} after {timeout:.0f} s; running anyway", flush=True)
            break
        print(f"load average {load_average()} >= {max_load}; waiting 60 s", flush=True)
        time.sleep(60)
    return round(time.monotonic() - start, 1)


def timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """``fn()``, its wall seconds, and the cores it kept busy (process CPU time / wall time:
    close to the thread count on a quiet machine, lower when other work competes)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    seconds = time.perf_counter() - wall
    return result, seconds, round((time.process_time() - cpu) / seconds, 2)


def run_environment() -> dict[str, Any]:
    """Library versions, the load average now and a UTC timestamp, for a result file."""
    return {
        "torch_version": version("torch"),
        "transformers_version": version("transformers"),
        "load_average_at_end": load_average(),
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write ``result`` as indented JSON, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def print_report(report: Any, path: Path | None) -> None:
    """Print a report dataclass as indented JSON, and write it to ``path`` when given."""
    text = json.dumps(dataclasses.asdict(report), indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


def run_kernel_benchmark(
    bench: Callable[[Any], dict[str, Any]], args: Any, name: str
) -> dict[str, Any]:
    """Run a GPU kernel microbenchmark's ``bench(args)``; returns (and writes to ``args.out``)
    its results. ``args.device`` "cpu" runs the Triton kernels in the interpreter (set before
    they are first imported); a CUDA device must be there."""
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"{name} needs a CUDA GPU (or --device cpu)")
    result = bench(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}", flush=True)
    return result


def median_step_ms(
    num_steps: int, prepare: Callable[[int], T], step: Callable[[int, T], object]
) -> float:
    """Median milliseconds of ``step(i, prepare(i))`` over ``num_steps`` steps; ``prepare``
    (e.g. drawing fresh logits) is not timed."""
    timings = []
    for index in range(num_steps):
        prepared = prepare(index)
        start = time.perf_counter()
        step(index, prepared)
        timings.append(time.perf_counter() - start)
    return 1000 * statistics.median(timings)


def step_bench_parser(description: str) -> argparse.ArgumentParser:
    """The options of a sampler micro-benchmark: ``--batches`` (rows per step, default 1 and
    32) and ``--steps`` (timed steps per batch, default 40)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=40)
    return parser


def median_kernel_seconds(fn: Callable[[], None], device: str, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls after a first one (which compiles):
    CUDA events on a GPU (the host's launch overhead does not count), the wall clock on a CPU."""
    import torch

    fn()
    times = []
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    for _ in range(iters):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def save_figure(fig: Any, path: Path) -> None:
    """Write a matplotlib figure (creating the folder) and release it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
