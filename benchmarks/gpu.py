"""GPU benchmark: output tok/s of the CB engine against transformers on random llama weights.

Run by hand on a GPU machine (not a test; the CPU only imports it and prints ``--help``):

    .venv/bin/python benchmarks/gpu.py [--shapes 1b] [--batches 1 32 256] [--prompt-len 128]
        [--new-tokens 128] [--dtype bfloat16] [--systems engine hf hf-compile]
        [--enforce-eager] [--bandwidth-gbs 3000] [--out benchmarks/results/gpu.json]

For each shape a random-initialised llama checkpoint is written to a temporary folder (no
download: the tokenizer is the local default model's, whose vocabulary the shapes share), then
each system generates ``--new-tokens`` greedy tokens (EOS ignored) for ``batch`` random prompts:

* ``engine``: the CB engine (Triton kernels and CUDA graphs unless ``--enforce-eager``);
* ``hf``: transformers ``generate`` on the whole batch (static batching, dynamic cache);
* ``hf-compile``: the same with a static cache and ``torch.compile(mode="reduce-overhead")``.

Each run is also timed with one new token; the difference gives the time of one decode step,
reported beside its memory-bandwidth floor (weights + the batch's K/V read once per step at
``--bandwidth-gbs``). Results go to a JSON file and a bar chart next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152
#: Llama shapes by name (the vocabulary is the default tokenizer's).
SHAPES: dict[str, dict[str, int]] = {
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
}
SYSTEMS = ("engine", "hf", "hf-compile")
#: The engine's KV pool, fixed (``num_blocks``) so that transformers, run after it in the same
#: process, still has room (``gpu_memory_utilization`` would hand the pool most of the GPU).
KV_POOL_GIB = 16
BLOCK_SIZE = 16


def build_checkpoint(
    shape: str, dtype: torch.dtype, folder: Path, max_len: int
) -> tuple[Path, int]:
    """Write a random-initialised llama of ``shape`` to ``folder`` (safetensors + config);
    returns the folder and the bytes of its weights (tied embeddings counted once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    return folder, sum(p.numel() * p.element_size() for p in model.parameters())


def random_prompts(batch: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(100, VOCAB_SIZE, (batch, length), generator=gen).tolist()


def timed(fn: Callable[[], object]) -> float:
    """Seconds of one call, the GPU's queue drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def engine_runner(path: Path, dtype: str, max_batch: int, enforce_eager: bool, num_blocks: int):
    """One engine factory per shape: the model, KV pools and CUDA graphs are built once."""
    from server.continuous_batching.engine import LLMEngine
    from server.continuous_batching.engine_config import EngineConfig
    from server.continuous_batching.model_runner import ModelRunner

    config = EngineConfig.model_validate(
        {
            "model_loading_config": {
                "model_name_or_path": str(path),
                "tokenizer_name_or_path": str(DEFAULT_TOKENIZER),
                "torch_dtype": dtype,
                "device": "cuda",
                "enforce_eager": enforce_eager,
            },
            "batcher_config": {"batch_max_tokens": 8192, "batch_max_beams": max_batch},
            "cache_config": {
                "num_blocks": num_blocks,
                "block_size": BLOCK_SIZE,
                "num_blocks_cpu": 0,
            },
        }
    )
    runner = ModelRunner(config)
    return lambda: LLMEngine(config, runner=runner)


def run_engine(make_engine, prompts: list[list[int]], new_tokens: int) -> None:
    from protocol.generation import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    make_engine().generate(prompts, [config] * len(prompts))


def hf_model(path: Path, dtype: torch.dtype, compiled: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    if compiled:
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    return model


def run_hf(model, prompts: list[list[int]], new_tokens: int) -> None:
    ids = torch.tensor(prompts, device="cuda")
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )


def bandwidth_floor_ms(
    weight_bytes: int, kv_bytes_per_token: int, batch: int, context: int, gbs: float
) -> float:
    """The least time a decode step can take: every weight and cached K/V read once."""
    return (weight_bytes + kv_bytes_per_token * batch * context) / (gbs * 1e9) * 1e3


def measure(
    run: Callable[[list[list[int]], int], None], batch: int, args: argparse.Namespace
) -> dict[str, float]:
    prompts = random_prompts(batch, args.prompt_len)
    run(prompts, 2)  # warm-up: kernels compiled, graphs captured, caches allocated
    total = timed(lambda: run(prompts, args.new_tokens))
    first = timed(lambda: run(prompts, 1))
    step_ms = (total - first) / max(1, args.new_tokens - 1) * 1e3
    return {"tok_s": batch * args.new_tokens / total, "seconds": total, "decode_step_ms": step_ms}


def bench_shape(shape: str, args: argparse.Namespace, folder: Path) -> list[dict[str, object]]:
    dtype = getattr(torch, args.dtype)
    max_len = args.prompt_len + args.new_tokens + 16
    path, weight_bytes = build_checkpoint(shape, dtype, folder / shape, max(max_len, 2048))
    s = SHAPES[shape]
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    kv_per_token = 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim
    kv_per_token *= dtype.itemsize
    rows: list[dict[str, object]] = []
    for system in args.systems:
        if system == "engine":
            num_blocks = KV_POOL_GIB * 2**30 // (kv_per_token * BLOCK_SIZE)
            make = engine_runner(
                path, args.dtype, max(args.batches), args.enforce_eager, num_blocks
            )

            def run(prompts: list[list[int]], n: int, make=make) -> None:
                run_engine(make, prompts, n)
        else:
            model = hf_model(path, dtype, compiled=system == "hf-compile")

            def run(prompts: list[list[int]], n: int, model=model) -> None:
                run_hf(model, prompts, n)

        for batch in args.batches:
            result = measure(run, batch, args)
            context = args.prompt_len + args.new_tokens // 2
            floor = bandwidth_floor_ms(
                weight_bytes, kv_per_token, batch, context, args.bandwidth_gbs
            )
            row = {"shape": shape, "system": system, "batch": batch, **result}
            row["bandwidth_floor_ms"] = floor
            print(json.dumps(row), flush=True)
            rows.append(row)
        torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({str(r["shape"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        mine = [r for r in rows if r["shape"] == shape]
        batches = sorted({int(r["batch"]) for r in mine})
        systems = [s for s in SYSTEMS if any(r["system"] == s for r in mine)]
        width = 0.8 / max(1, len(systems))
        for i, system in enumerate(systems):
            by_batch = {int(r["batch"]): float(r["tok_s"]) for r in mine if r["system"] == system}
            xs = [j + i * width for j in range(len(batches))]
            ax.bar(xs, [by_batch.get(b, 0.0) for b in batches], width, label=system)
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(batches))])
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel("batch")
        ax.set_ylabel("output tok/s")
        ax.set_title(f"llama {shape}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["1b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--enforce-eager", action="store_true", help="engine without graphs")
    parser.add_argument("--bandwidth-gbs", type=float, default=3000.0, help="GPU memory GB/s")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/gpu.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU")
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            rows += bench_shape(shape, args, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **vars(args)}
    meta["out"] = str(args.out)
    args.out.write_text(json.dumps({"config": meta, "results": rows}, indent=2))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
