"""Where an engine step's host time goes: cProfile over steady decode steps of one batch.

    python -m benchmarks.step_profile --shape 1b --batch 256 [--steps 30] [--device cuda]
    python -m benchmarks.step_profile --shape tiny --batch 256 --device cpu   # host side only

The engine is built as ``benchmarks.gpu`` builds it (random llama of ``--shape``, the default
tokenizer), every prompt is prefilled, then ``--steps`` engine steps run under cProfile. It
prints the functions with the most own time and the most cumulative time, per step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
from pathlib import Path

import torch

from benchmarks.gpu import SHAPES, EngineBench, build_checkpoint, parse_args
from benchmarks.gpu_transformers import random_prompts


def profile_steps(bench: EngineBench, batch: int, args: argparse.Namespace) -> pstats.Stats:
    """Prefill ``batch`` random prompts, then profile ``args.decode_steps`` engine steps."""
    prompts = random_prompts(batch, args.prompt_len)
    bench.generate(prompts, 2)  # warm-up: kernels compiled, graphs captured
    profiler = cProfile.Profile()
    original = bench.engine.step

    def profiled_step():  # only the timed window's steps are profiled
        profiler.enable()
        try:
            return original()
        finally:
            profiler.disable()

    bench.engine.step = profiled_step
    bench.decode_steps(prompts, args)
    bench.engine.step = original
    return pstats.Stats(profiler)


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, profile, print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="1b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=35)
    ours = parser.parse_args(argv)
    args = parse_args(
        ["--shapes", ours.shape, "--batches", str(ours.batch), "--device", ours.device,
         "--decode-steps", str(ours.steps)]
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        max_len = max(args.prompt_len + args.new_tokens + 16, 2048)
        path, _ = build_checkpoint(ours.shape, getattr(torch, args.dtype), Path(tmp), max_len,
                                   ours.device)  # fmt: skip
        bench = EngineBench(path, args)
        try:
            stats = profile_steps(bench, ours.batch, args)
        finally:
            bench.close()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        stats.stream = text
        stats.sort_stats(key).print_stats(ours.top)
        print(f"--- per {ours.steps} steps, by {key} ---")
        print(text.getvalue())


if __name__ == "__main__":
    main()
