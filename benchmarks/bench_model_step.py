"""Micro-benchmark: one decode step of the CB model vs transformers with a DynamicCache.

Run by hand (not a test), on a quiet machine:

    .venv/bin/python -m benchmarks.bench_model_step [--batches 32 64] [--context 200]
        [--dtypes bfloat16 float32] [--threads 2] [--profile] [--no-hf] [--prefill 100 200]

Each configuration times ``--steps`` decode steps of ours and of transformers, alternating
(so machine noise hits both alike), and prints the median and minimum. Ours: metadata build +
forward + logits of every row (what the runner does per step). transformers: a forward of
[batch, 1] tokens over a DynamicCache pre-filled with random K/V at the same context length
and a left-padding attention mask, as static batching runs it (logits of the last token only).
The cache content is random: speed does not depend on it. ``--prefill N`` also times ours
prefilling one fresh N-token prompt (the logits of its last token): what a request's first
token waits for, without the server around it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from server.continuous_batching.engine_config import ModelLoadingConfig  # noqa: E402
from server.continuous_batching.model import (  # noqa: E402
    LlamaForCausalLM,
    build_attention_metadata,
    kv_cache_shape,
)
from server.continuous_batching.model.decoder_ops import TorchDecoderOps  # noqa: E402
from server.continuous_batching.model.weights import load_model  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def time_interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Wall times (ms) of one call of each function, alternating between them every round so
    that machine noise (shared cores, memory bandwidth) hits all of them alike."""
    for fn in fns.values():
        for _ in range(2):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def ours_step(
    model: LlamaForCausalLM, batch: int, context: int, ops: TorchDecoderOps | None = None
) -> Callable[[], torch.Tensor]:
    """A closure running one decode step for ``batch`` sequences of ~``context`` tokens, with
    the model's decoder ops or (switched in before each step) ``ops``."""
    c = model.config
    blocks_per_seq = -(-(context + 8) // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    shape = kv_cache_shape(c, num_blocks, BLOCK_SIZE)
    caches = [
        (torch.randn(shape).to(model.dtype), torch.randn(shape).to(model.dtype))
        for _ in range(c.num_hidden_layers)
    ]
    perm = torch.randperm(num_blocks - 1).add(1).tolist()  # scattered blocks, like a real pool
    tables = [perm[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    contexts = [context - 8 + (i % 17) for i in range(batch)]  # a little spread, as in serving
    ids = torch.randint(0, c.vocab_size, (batch,))
    positions = torch.tensor([n - 1 for n in contexts])

    def step() -> torch.Tensor:
        if ops is not None:
            model.set_decoder_ops(ops)
        kernel = model.attention_backend != "torch"
        meta = build_attention_metadata(
            [1] * batch, contexts, tables, BLOCK_SIZE, model.device, with_decode_tables=kernel
        )
        hidden = model(ids, positions, caches, meta, block_size=BLOCK_SIZE)
        return model.compute_logits(hidden)

    return step


def ours_prefill(model: LlamaForCausalLM, num_tokens: int) -> Callable[[], torch.Tensor]:
    """A closure prefilling one fresh ``num_tokens``-token prompt (what a request waits for
    before its first token): every layer over the prompt, the logits of its last token."""
    c = model.config
    num_blocks = -(-num_tokens // BLOCK_SIZE) + 1
    shape = kv_cache_shape(c, num_blocks, BLOCK_SIZE)
    caches = [
        (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
        for _ in range(c.num_hidden_layers)
    ]
    table = list(range(1, num_blocks))
    ids = torch.randint(0, c.vocab_size, (num_tokens,))
    positions = torch.arange(num_tokens)

    def step() -> torch.Tensor:
        kernel = model.attention_backend != "torch"
        meta = build_attention_metadata(
            [num_tokens],
            [num_tokens],
            [table],
            BLOCK_SIZE,
            model.device,
            with_decode_tables=kernel,
            kernel_takes_prefill=model.attention_backend == "cpu",  # as the runner plans it
        )
        hidden = model(ids, positions, caches, meta, block_size=BLOCK_SIZE)
        return model.compute_logits(hidden[-1:])

    return step


def hf_step(hf: torch.nn.Module, batch: int, context: int) -> Callable[[], torch.Tensor]:
    """A closure running one transformers decode step over a DynamicCache (grows per call)."""
    from transformers import DynamicCache

    c = hf.config
    dtype = next(hf.parameters()).dtype
    kv_shape = (batch, c.num_key_value_heads, context, c.head_dim)
    cache = DynamicCache(config=c)
    for layer in range(c.num_hidden_layers):
        cache.update(torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype), layer)
    ids = torch.randint(0, c.vocab_size, (batch, 1))

    def step() -> torch.Tensor:
        seen = cache.get_seq_length()
        mask = torch.ones(batch, seen + 1, dtype=torch.long)
        # Static batches are left-padded: an all-ones mask would take another (slower on CPU)
        # SDPA path than generate() really uses.
        mask[::2, :8] = 0
        with torch.inference_mode():
            out = hf(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        return out.logits

    return step


def profile(step: Callable[[], object], label: str, rows: int = 15) -> None:
    """Print the top ops by self CPU time over a few steps."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    print(f"--- profile: {label} (5 steps) ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--batches", type=int, nargs="*", default=[32, 64])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=DTYPES)
    parser.add_argument("--steps", type=int, default=15, help="timed rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--prefill",
        type=int,
        nargs="*",
        default=[],
        help="also time the prefill of one prompt of each of these lengths (ours only)",
    )
    parser.add_argument("--profile", action="store_true", help="torch.profiler top ops (ours)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument(
        "--torch-ops",
        action="store_true",
        help="also time ours with the plain torch decoder ops (no fused CPU kernels)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={torch.get_num_threads()} context~{args.context} model={args.model}")
    for name in args.dtypes:
        dtype = DTYPES[name]
        model, _ = load_model(ModelLoadingConfig(model_name_or_path=args.model, torch_dtype=name))
        model_ops = model.decoder_ops  # what the engine runs (the fused CPU kernels if built)
        hf = None
        if not args.no_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
        for num_tokens in args.prefill:
            times = time_interleaved({"ours": ours_prefill(model, num_tokens)}, args.steps)["ours"]
            med, best = statistics.median(times), min(times)
            print(f"{name:9s} prefill {num_tokens:4d}: | ours {med:6.1f} ms (min {best:6.1f})")
        for batch in args.batches:
            fns = {"ours": ours_step(model, batch, args.context, model_ops)}
            if args.torch_ops:
                fns["ours_torch_ops"] = ours_step(model, batch, args.context, TorchDecoderOps())
            if hf is not None:
                fns["transformers"] = hf_step(hf, batch, args.context)
            times = time_interleaved(fns, args.steps)
            line = f"{name:9s} batch {batch:3d}:"
            for label, ts in times.items():
                med, best = statistics.median(ts), min(ts)
                line += f" | {label} {med:6.1f} ms/step (min {best:6.1f})"
                line += f" {batch / med * 1e3:5.0f} tok/s"
            if hf is not None:
                ratio = statistics.median(times["transformers"]) / statistics.median(times["ours"])
                line += f" | speed-up {ratio:4.2f}x"
            if args.torch_ops:
                torch_ops = statistics.median(times["ours_torch_ops"])
                ratio = torch_ops / statistics.median(times["ours"])
                line += f" | fused ops speed-up {ratio:4.2f}x"
            print(line, flush=True)
            if args.profile:
                profile(fns["ours"], f"ours {name} batch {batch}")


if __name__ == "__main__":
    main()
