"""GPU benchmark: the CB engine against transformers, like for like, beside the bandwidth floor.

Run on a GPU machine from a plain checkout (no install needed; the default tokenizer folder
``models/SmolLM2-135M-Instruct`` must be there, ``make model`` or the device tool's ``carry``):

    python -m benchmarks.gpu [--shapes 1b 8b] [--batches 1 32 256] [--prompt-len 128]
        [--new-tokens 128] [--decode-steps 50] [--dtype bfloat16]
        [--systems engine hf-compile] [--enforce-eager] [--bandwidth-gbs 3350]
        [--out benchmarks/results/gpu.json]

and on a CPU as a smoke test (what ``tests/benchmarks/test_gpu_benchmark.py`` runs):

    python -m benchmarks.gpu --shape tiny --device cpu --batches 2 --new-tokens 4 ...

For each shape a random-initialised llama checkpoint is written to a temporary folder (no
download; the vocabulary is the default tokenizer's), then, one system after the other in this
process (each freed before the next loads):

* ``engine``: the CB engine (Triton kernels and CUDA graphs unless ``--enforce-eager``), its
  model, KV pool, graphs and tokenizer built **once**, outside every timing;
* ``hf-compile``: transformers ``generate`` with its own static-cache compile path
  (``cache_implementation="static"``: generate compiles the decode forward itself). If that
  fails (torch 2.11 + transformers 5.17 crashed in CUDA graphs), the error is reported and the
  row falls back to the static cache without compile (``compiled: false`` and ``fallback``);
* ``hf-static`` (static cache, compile disabled) and ``hf`` (dynamic cache) on request.

Per (shape, system, batch), greedy with EOS ignored, ``batch`` random prompts of
``--prompt-len`` tokens, after one untimed warm-up run:

* ``tok_s``: end to end, ``batch * new_tokens`` over the seconds of one whole run;
* ``decode_step_ms``: the steady decode step. Engine: ``--decode-steps`` engine steps timed
  after every prompt is prefilled (mean, with median/min/max). transformers (one ``generate``
  call holds both phases): (run of ``new_tokens`` - run of 1 token) / (new_tokens - 1);
* ``host_ms_per_step`` (engine): the host's own work per step, the step's wall time minus the
  time it waited for the device in the step's token read (the one sync of a plain step);
* ``bandwidth_floor_ms``: weights + the batch's K/V at the mean context read once per step, at
  ``--bandwidth-gbs`` (default: the H100 SXM's 3,350 GB/s); ``floor_ratio`` = step / floor.

Results: a JSON file (``--out``) and a plot next to it (when matplotlib imports; else a
message says it was skipped).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_report import SYSTEMS, plot, ratios
from benchmarks.gpu_transformers import (
    VOCAB_SIZE,
    bench_hf,
    free_memory,
    random_prompts,
    report_row,
    sync,
    timed,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
#: Llama shapes by name (the vocabulary is the default tokenizer's).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {  # CPU smoke test only
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
    },
    "135m": {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
    },
    "1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
    },
    "3b": {  # Llama-3.2-3B's body
        "hidden_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
    },
    "8b": {  # Llama 3 8B's body: 16 GB of bf16 weights, fits one H100
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
    },
}
#: HBM bandwidth of an H100 SXM (GB/s), the default of ``--bandwidth-gbs``.
H100_GBS = 3350.0
BLOCK_SIZE = 16


def build_checkpoint(
    shape: str, dtype: torch.dtype, folder: Path, max_len: int, device: str
) -> tuple[Path, int]:
    """Write a random-initialised llama of ``shape`` to ``folder`` (safetensors + config);
    returns the folder and the bytes of its weights (tied embeddings counted once).

    Initialised on ``device`` (an 8B model initialises in seconds on a GPU, minutes on a CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    free_memory(device)
    return folder, weight_bytes


def kv_bytes_per_token(shape: str, dtype: torch.dtype) -> int:
    """K and V bytes one token takes over all layers."""
    s = SHAPES[shape]
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim * dtype.itemsize


def bandwidth_floor_ms(
    weight_bytes: int, kv_bytes_per_token: int, batch: int, context: float, gbs: float
) -> float:
    """The least time a decode step can take: every weight and cached K/V read once."""
    return (weight_bytes + kv_bytes_per_token * batch * context) / (gbs * 1e9) * 1e3


# -- the engine -----------------------------------------------------------------------------


class EngineBench:
    """One engine (model, KV pool, CUDA graphs, tokenizer) built once for all batches."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        from server.continuous_batching.engine import LLMEngine
        from server.continuous_batching.engine_config import EngineConfig
        from server.continuous_batching.runner.model_runner import ModelRunner

        max_batch = max(args.batches)
        per_seq = -(-(args.prompt_len + args.new_tokens + 1) // BLOCK_SIZE)
        loading: dict[str, Any] = {
            "model_name_or_path": str(path),
            "tokenizer_name_or_path": str(args.tokenizer),
            "torch_dtype": args.dtype,
            "device": args.device,
            "enforce_eager": args.enforce_eager,
        }
        for key in ("quantize_method", "gguf_activations"):  # benchmarks.at_load's variants
            if getattr(args, key, None) is not None:
                loading[key] = getattr(args, key)
        if args.device == "cpu":
            # The GPU benchmark's CPU smoke run skips the C++ build; a CPU benchmark
            # (benchmarks.families) measures with the kernels.
            loading["cpu_kernels"] = getattr(args, "is_cpu_kernels", False)
        config = EngineConfig.model_validate(
            {
                "model_loading_config": loading,
                "batcher_config": {
                    "batch_max_tokens": max(8192, args.prompt_len),
                    "batch_max_beams": max_batch,
                },
                # Sized to the largest batch (plus room), not to the GPU: transformers needs
                # memory after the engine is freed, and a huge pool only slows start-up.
                "cache_config": {
                    "num_blocks": max_batch * per_seq + 64,
                    "block_size": BLOCK_SIZE,
                    "num_blocks_cpu": 0,
                },
            }
        )
        self.device = args.device
        self.runner = ModelRunner(config)
        self.engine = LLMEngine(config, runner=self.runner)
        self.wait_seconds = 0.0
        sampler = self.engine.decoder.sampler
        read_tokens = sampler.read_tokens

        def timed_read(tokens: Any) -> list[int]:
            # The step's one wait for the device: its tokens read back.
            start = time.perf_counter()
            try:
                return read_tokens(tokens)
            finally:
                self.wait_seconds += time.perf_counter() - start

        sampler.read_tokens = timed_read  # instance attribute: the engine code is untouched

    def close(self) -> None:
        """Free the model, pools and graphs before transformers loads."""
        del self.engine, self.runner
        free_memory(self.device)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        """Every prompt to ``new_tokens`` greedy tokens, EOS ignored."""
        from protocol.generation import GenerationConfig

        config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
        results = self.engine.generate(prompts, [config] * len(prompts))
        made = [sum(d.num_new_tokens for d in deltas) for deltas in results]
        if made != [new_tokens] * len(prompts):
            raise RuntimeError(f"the engine made {made} tokens, not {new_tokens} each")

    def decode_steps(self, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
        """Time ``args.decode_steps`` engine steps once every prompt is prefilled."""
        from protocol.generation import GenerationConfig
        from server.common.backend import SequenceRequest

        config = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
        ids = [f"steady-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.engine.add_request(SequenceRequest(request_id, prompt, config))
        started: set[str] = set()
        steps_before = 0
        while len(started) < len(ids):  # prefill (chunked or not) until each has a token
            for output in self.engine.step():
                if any(d.num_new_tokens for d in output.deltas):
                    started.add(output.request_id)
            steps_before += 1
        times, host = [], []
        for _ in range(args.decode_steps):
            self.wait_seconds = 0.0
            sync(self.device)
            start = time.perf_counter()
            self.engine.step()
            sync(self.device)
            elapsed = time.perf_counter() - start
            times.append(elapsed)
            host.append(elapsed - self.wait_seconds)
        for request_id in ids:
            self.engine.abort(request_id)
        # Mean keys per sequence over the timed window: prompt, the first token, then one more
        # per step (a token is written the step after it is sampled).
        context = args.prompt_len + 1 + (args.decode_steps - 1) / 2 + (steps_before - 1)
        ms = [t * 1e3 for t in times]
        return {
            "decode_step_ms": statistics.fmean(ms),
            "decode_step_ms_median": statistics.median(ms),
            "decode_step_ms_min": min(ms),
            "decode_step_ms_max": max(ms),
            "host_ms_per_step": statistics.fmean(h * 1e3 for h in host),
            "host_ms_per_step_median": statistics.median(h * 1e3 for h in host),
            "mean_context": context,
        }


def bench_engine(
    path: Path, args: argparse.Namespace, floor: Callable[[int, float], float]
) -> list[dict[str, Any]]:
    """The engine's rows, one per batch."""
    bench = EngineBench(path, args)
    rows = []
    try:
        for batch in args.batches:
            prompts = random_prompts(batch, args.prompt_len)
            bench.generate(prompts, 2)  # warm-up: kernels compiled, buffers allocated
            seconds = timed(lambda p=prompts: bench.generate(p, args.new_tokens), args.device)
            steady = bench.decode_steps(prompts, args)
            row = {
                "system": "engine",
                "batch": batch,
                "tok_s": batch * args.new_tokens / seconds,
                "seconds": seconds,
                **steady,
                "bandwidth_floor_ms": floor(batch, steady["mean_context"]),
            }
            rows.append(row)
            report_row(row)
    finally:
        bench.close()
    return rows


# -- driver ---------------------------------------------------------------------------------


def bench_shape(shape: str, args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    """All systems' rows for one shape."""
    dtype = getattr(torch, args.dtype)
    max_len = max(args.prompt_len + args.new_tokens + 16, 2048)
    path, weight_bytes = build_checkpoint(shape, dtype, folder / shape, max_len, args.device)
    kv_per_token = kv_bytes_per_token(shape, dtype)

    def floor(batch: int, context: float) -> float:
        return bandwidth_floor_ms(weight_bytes, kv_per_token, batch, context, args.bandwidth_gbs)

    rows: list[dict[str, Any]] = []
    for system in args.systems:
        if system == "engine":
            rows += bench_engine(path, args, floor)
        else:
            rows += bench_hf(path, args, system, floor)
    for row in rows:
        row["shape"] = shape
        row["weight_bytes"] = weight_bytes
        row["floor_ratio"] = row["decode_step_ms"] / row["bandwidth_floor_ms"]
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", "--shape", nargs="+", choices=list(SHAPES), default=["1b", "8b"]
    )
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--decode-steps", type=int, default=50, help="engine steps timed after the prefill"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["engine", "hf-compile"])
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (smoke)")
    parser.add_argument("--enforce-eager", action="store_true", help="engine without graphs")
    parser.add_argument(
        "--bandwidth-gbs", type=float, default=H100_GBS, help="GPU memory GB/s (H100 SXM)"
    )
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/gpu.json")
    args = parser.parse_args(argv)
    if args.decode_steps < 1 or args.new_tokens < args.decode_steps + 2:
        parser.error("need 1 <= --decode-steps <= --new-tokens - 2")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns what it wrote to ``--out``."""
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU (or --device cpu for a smoke run)")
    if not args.tokenizer.is_dir():
        raise SystemExit(f"tokenizer folder {args.tokenizer} not found (make model)")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            rows += bench_shape(shape, args, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    meta = {"device_name": device_name, "torch": torch.__version__, **vars(args)}
    meta.update(out=str(args.out), tokenizer=str(args.tokenizer))
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    result = {"config": meta, "results": rows, "ratios": ratios(rows)}
    args.out.write_text(json.dumps(result, indent=2))
    for r in result["ratios"]:
        print(json.dumps(r), flush=True)
    png = args.out.with_suffix(".png")
    print(f"wrote {args.out}" + (f" and {png}" if plot(rows, png) else ""), flush=True)
    return result


if __name__ == "__main__":
    main()
