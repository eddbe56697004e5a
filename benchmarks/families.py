"""Decode speed per model family at one ~1B shape, against llama of the same size (issue #33).

Every family gets llama 1B's body (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192,
the default tokenizer's 49,152-token vocabulary, tied embeddings where the family allows) with
its own parts on top: Qwen2's qkv bias, Qwen3's q/k norms, Phi-3's fused projections, Gemma's
extra norms, GeGLU, soft-caps and sliding layers, a 4,096-token window for Mistral. The MoE
families get 4 experts of MLP 4096 with top-2 routing, so about 1B parameters are active per
token, as in llama. ``gemma3_hd256`` is Gemma 3 with its real head size (256; 8 query / 4 KV
heads keep the projections' sizes). Each checkpoint is random (transformers' own config and
model classes, seeded), written to a temporary folder, loaded by the CB engine (bf16 by
default, the fused CPU kernels) and timed one family after the other in this process, llama
after each of them:

* ``decode_step_ms``: the mean of ``--decode-steps`` engine steps once every prompt of the
  batch is prefilled (``--prompt-len`` random tokens each), after an untimed warm-up;
* ``tok_s`` = batch / step; ``active_params``: the parameters the step multiplies by (the
  embedding table only as the tied LM head; of the experts, the share the batch's tokens
  touch: top-2 of 4 for one token, and under uniform routing 1 - (1/2)^8 of them, nearly
  all, for 8 tokens, whose weights are then read once each);
* ``ms_per_active_b`` = step ms per billion active parameters, and ``vs_llama`` its ratio to
  llama's at the same batch (issue #33's bar: at most 1.2 on a CPU), llama being measured
  again right after each family (it stays loaded): the machine's speed drifts between
  minutes by more than the families differ. llama's row is the median of its samples.

Run on a quiet machine:

    python -m benchmarks.families [--families llama qwen3 ...] [--batches 1 8] [--shape 3b|tiny]
        [--prompt-len 64] [--decode-steps 16] [--dtype bfloat16]
        [--out benchmarks/results/families_cpu.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import load_average, run_environment, wait_for_quiet_machine
from benchmarks.gpu import DEFAULT_TOKENIZER, REPO_ROOT, SHAPES, EngineBench
from benchmarks.gpu_transformers import VOCAB_SIZE, random_prompts

#: Llama 1B's body (benchmarks.gpu's "1b" shape).
BODY: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
#: Llama-3.2-3B's body (``--shape 3b``; benchmarks.gpu's "3b" shape), over BODY, with its head
#: size for every family: 2.97 B parameters with our 49k vocab.
SHAPE_3B: dict[str, Any] = {**SHAPES["3b"], "head_dim": 128}
#: A CPU smoke run's sizes (``--shape tiny``), over BODY and each family's fields.
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
#: 4 experts of MLP 4096, 2 routed per token: the active MLP is llama's 8192.
MOE = {"intermediate_size": 4096, "num_experts_per_tok": 2}

#: Family -> (transformers config class, fields over BODY).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 64}),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "tie_word_embeddings": False}),
    "gemma2": ("Gemma2Config", {"head_dim": 64, "query_pre_attn_scalar": 64}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 64, "sliding_window": 512}),
    "gemma3_hd256": (
        "Gemma3TextConfig",
        {"head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 4},
    ),
    "mixtral": ("MixtralConfig", {**MOE, "num_local_experts": 4}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": 64, "moe_intermediate_size": 4096, "num_experts": 4, **MOE},
    ),
}


def body_fields(family: str, shape: str = "1b") -> dict[str, Any]:
    """The transformers config fields of ``family`` at ``shape``: ``1b`` (BODY), ``3b``
    (Llama-3.2-3B's body, dense families only: every family then has its attention shape) or
    ``tiny``."""
    fields = {**BODY, **FAMILIES[family][1]}
    if shape == "3b":
        if "num_experts_per_tok" in fields:
            raise ValueError(f"the 3b shape is a dense body; {family} is a mixture of experts")
        fields.update(SHAPE_3B)
    elif shape == "tiny":
        fields.update({k: v for k, v in TINY.items() if k in fields or "moe" not in k})
        if "moe_intermediate_size" not in FAMILIES[family][1]:
            fields.pop("moe_intermediate_size", None)
    elif shape != "1b":
        raise ValueError(f"unknown shape {shape!r}: 1b, 3b or tiny")
    return fields


def build_checkpoint(
    family: str, folder: Path, dtype: torch.dtype, batches: list[int], shape: str = "1b"
) -> dict[int, int]:
    """Write the family's random checkpoint (``body_fields``' shape) to ``folder``; returns its
    active parameters per batch size."""
    import transformers

    class_name = FAMILIES[family][0]
    fields = body_fields(family, shape)
    config = getattr(transformers, class_name)(**fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.save_pretrained(folder)
    num_active = {batch: active_params(model, config, batch) for batch in batches}
    del model
    gc.collect()
    return num_active


def num_experts_of(config: Any) -> int:
    """The experts per MoE layer (0: dense)."""
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0) or 0


def expert_share(config: Any, batch: int) -> float:
    """The share of a layer's experts one step multiplies by: top-k of E for one token; for a
    batch, the expected share of distinct experts its tokens touch under uniform routing,
    1 - (1 - k/E)^batch (every expert's weights are read once however many tokens use it)."""
    num_experts = num_experts_of(config)
    if not num_experts:
        return 1.0
    return 1.0 - (1.0 - config.num_experts_per_tok / num_experts) ** batch


def active_params(model: torch.nn.Module, config: Any, batch: int = 1) -> int:
    """Parameters a step of ``batch`` tokens multiplies by: the input embedding table is a
    lookup (counted only as the tied LM head), and experts count by ``expert_share``."""
    share = expert_share(config, batch)
    total = 0.0
    for name, param in model.named_parameters(remove_duplicate=False):
        if "embed_tokens" in name and not config.tie_word_embeddings:
            continue  # untied: the LM head is its own parameter
        if "lm_head" in name and config.tie_word_embeddings:
            continue  # tied: counted once, as embed_tokens
        total += param.numel() * (share if ".experts." in name else 1.0)
    return int(total)


def measure(
    bench: EngineBench, family: str, num_active: dict[int, int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One row per batch size: the loaded engine's steady decode step."""
    rows = []
    for batch in args.batches:
        prompts = random_prompts(batch, args.prompt_len)
        bench.generate(prompts, 2)  # warm-up
        steady = bench.decode_steps(prompts, args)
        step_ms = steady["decode_step_ms"]
        row = {
            "family": family,
            "batch": batch,
            "decode_step_ms": round(step_ms, 2),
            "decode_step_ms_median": round(steady["decode_step_ms_median"], 2),
            "tok_s": round(batch * 1e3 / step_ms, 2),
            "active_params": num_active[batch],
            "ms_per_active_b": round(step_ms / (num_active[batch] / 1e9), 2),
            "load_average": load_average(),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def bench_family(
    family: str, args: argparse.Namespace, tmp: Path, baseline: Callable[[], list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """The family's rows, one per batch, each with ``vs_llama`` against llama measured right
    after it (``baseline()``): a 2-core machine's speed drifts by tens of percent between
    minutes, far more than between two measurements in a row."""
    folder = tmp / family
    dtype = getattr(torch, args.dtype)
    num_active = build_checkpoint(family, folder, dtype, args.batches, args.shape)
    bench = EngineBench(folder, args)
    try:
        rows = measure(bench, family, num_active, args)
    finally:
        bench.close()
        for path in folder.iterdir():
            path.unlink()
    llama = {r["batch"]: r for r in baseline()}
    for row in rows:
        base = llama[row["batch"]]
        row["llama_ms_per_active_b"] = base["ms_per_active_b"]
        row["vs_llama"] = round(row["ms_per_active_b"] / base["ms_per_active_b"], 2)
    return rows


def llama_summary(samples: list[dict[str, Any]], batches: list[int]) -> list[dict[str, Any]]:
    """llama's rows: per batch, the median of its samples (the first row of each family's
    comparison), with their spread."""
    rows = []
    for batch in batches:
        mine = sorted(
            (r for r in samples if r["batch"] == batch), key=lambda r: r["ms_per_active_b"]
        )
        row = dict(mine[len(mine) // 2])
        row["vs_llama"] = 1.0
        row["num_samples"] = len(mine)
        row["ms_per_active_b_range"] = [mine[0]["ms_per_active_b"], mine[-1]["ms_per_active_b"]]
        rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as the Markdown table of benchmarks/README.md."""
    lines = [
        "| family | batch | active params | decode step ms | tok/s | ms per active B | vs llama |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['batch']} | {r['active_params'] / 1e9:.2f} B "
            f"| {r['decode_step_ms']} | {r['tok_s']} | {r['ms_per_active_b']} "
            f"| {r.get('vs_llama', '-')} |"
        )
    return "\n".join(lines)


def add_shape_argument(parser: argparse.ArgumentParser) -> None:
    """``--shape``: the body ``body_fields`` builds (here and in the real-size benchmarks)."""
    parser.add_argument(
        "--shape",
        choices=["1b", "3b", "tiny"],
        default="1b",
        help="1b: Llama-3.2-1B's body; 3b: Llama-3.2-3B's (dense families); tiny: smoke run",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_argument(parser)
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--wait-for-load", type=float, default=None, help="1-min load to wait")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks/results/families_cpu.json"
    )
    args = parser.parse_args(argv)
    # What EngineBench reads: the CPU, eager, with the fused kernels.
    args.device, args.enforce_eager, args.is_cpu_kernels = "cpu", True, True
    args.new_tokens = args.decode_steps + 2
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table and write ``--out``."""
    args = parse_args(argv)
    waited = wait_for_quiet_machine(args.wait_for_load)
    rows: list[dict[str, Any]] = []
    llama_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        # llama stays loaded: it is measured again right after every family.
        dtype = getattr(torch, args.dtype)
        llama_active = build_checkpoint(
            "llama", Path(tmp) / "llama", dtype, args.batches, args.shape
        )
        llama = EngineBench(Path(tmp) / "llama", args)

        def baseline() -> list[dict[str, Any]]:
            llama_rows.extend(measure(llama, "llama", llama_active, args))
            return llama_rows[-len(args.batches) :]

        try:
            baseline()  # first, as a warm-up of the machine too
            for family in args.families:
                if family != "llama":
                    rows += bench_family(family, args, Path(tmp), baseline)
        finally:
            llama.close()
    rows = llama_summary(llama_rows, args.batches) + rows
    config = {**vars(args), "tokenizer": str(args.tokenizer), "out": str(args.out)}
    result = {
        "config": config,
        "waited_seconds": waited,
        "environment": run_environment(),
        "results": rows,
        "llama_samples": llama_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown_table(rows), flush=True)
    print(f"wrote {args.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
