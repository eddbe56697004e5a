"""transformers' side of ``benchmarks.gpu`` (``generate`` with its static-cache compile path,
or without), and the timing helpers both sides of that benchmark use."""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: The vocabulary of every random checkpoint: the default tokenizer's.
VOCAB_SIZE = 49152


def random_prompts(batch: int, length: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` random token ids (seeded by the batch)."""
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(100, VOCAB_SIZE, (batch, length), generator=gen).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def timed(fn: Callable[[], object], device: str) -> float:
    """Seconds of one call, the device's queue drained before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def report_row(row: dict[str, Any]) -> None:
    """Print one result row as a JSON line (as soon as it is measured)."""
    print(json.dumps(row), flush=True)


# -- transformers ---------------------------------------------------------------------------


def hf_model(path: Path, args: argparse.Namespace, system: str) -> Any:
    """transformers' model, set up for ``system`` (static cache for all but plain ``hf``;
    compiled by generate itself for ``hf-compile``, never wrapped in torch.compile here)."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=args.device)
    model.eval()
    if system != "hf":
        model.generation_config.cache_implementation = "static"
    model.generation_config.disable_compile = system != "hf-compile"
    return model


def run_hf(model: Any, prompts: list[list[int]], new_tokens: int) -> None:
    """One greedy ``generate`` over the whole batch, exactly ``new_tokens`` each."""
    ids = torch.tensor(prompts, device=model.device)
    budget = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **budget)
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"transformers made {out.shape[1] - ids.shape[1]} tokens")


def measure_hf(model: Any, batch: int, args: argparse.Namespace) -> dict[str, float]:
    """End-to-end tok/s and the decode step of one batch (after a warm-up)."""
    prompts = random_prompts(batch, args.prompt_len)
    # Warm-up with the timed runs' own lengths: the static cache is sized by the first run's
    # length and a later, longer run re-sizes it and recompiles inside the timing.
    run_hf(model, prompts, args.new_tokens)
    run_hf(model, prompts, 1)
    total = timed(lambda: run_hf(model, prompts, args.new_tokens), args.device)
    first = timed(lambda: run_hf(model, prompts, 1), args.device)
    step_ms = (total - first) / max(1, args.new_tokens - 1) * 1e3
    return {"tok_s": batch * args.new_tokens / total, "seconds": total, "decode_step_ms": step_ms}


def bench_hf(
    path: Path, args: argparse.Namespace, system: str, floor: Callable[[int, float], float]
) -> list[dict[str, Any]]:
    """transformers' rows for ``system``, one per batch. ``hf-compile`` falls back to the
    static cache without compile, for this and the later batches, if compiling fails."""
    model = hf_model(path, args, system)
    compiled = system == "hf-compile" and args.device.startswith("cuda")
    fallback: str | None = None
    rows = []
    context = args.prompt_len + args.new_tokens / 2
    try:
        for batch in args.batches:
            try:
                result = measure_hf(model, batch, args)
            except Exception as exc:  # noqa: BLE001 - any compile/graph failure falls back
                if not compiled:
                    raise
                fallback = f"{type(exc).__name__}: {str(exc)[:400]}"
                print(
                    f"hf-compile failed at batch {batch} ({fallback}); falling back to the "
                    "static cache WITHOUT compile for this and the later batches",
                    flush=True,
                )
                compiled = False
                model.generation_config.disable_compile = True
                torch._dynamo.reset()
                result = measure_hf(model, batch, args)
            row = {"system": system, "batch": batch, **result, "compiled": compiled}
            if fallback:
                row["fallback"] = f"static cache without compile after: {fallback}"
            row["bandwidth_floor_ms"] = floor(batch, context)
            rows.append(row)
            report_row(row)
    finally:
        del model
        torch._dynamo.reset()
        free_memory(args.device)
    return rows
