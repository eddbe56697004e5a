"""Micro-benchmark: what OpenAI's sampling knobs cost the CB sampler per engine step.

Run by hand (not a test), on a quiet machine:

    .venv/bin/python -m benchmarks.bench_logit_knobs [--batches 1 32] [--vocab 49152]
        [--generated 128] [--steps 200] [--threads 2]

One "step" is one :func:`server.continuous_batching.sampling.draws.sample` call over ``[batch,
vocab]`` float32 logits (what the engine's decoder asks of the sampler once per step), for every
row alike: greedy without knobs (the fast path, one argmax), greedy with each knob
(``logit_bias`` of 10 tokens, presence + frequency penalties over ``--generated`` generated
tokens), ``allowed_token_ids`` of 64 tokens, ``bad_words`` (10 words of one and two tokens),
greedy with all of them, sampling (temperature 0.8, top-p 0.95) without and with
``min_p``, and sampling with every knob. Configurations alternate step by step, so machine noise
hits them alike; the median and the minimum of each are printed, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.sampling.draws import sample

PROMPT_LEN = 100


def _rows(kind: str, batch: int, vocab: int, generated: int) -> list[RowParams]:
    """``batch`` rows of one configuration (each row its own token list)."""
    rows = []
    for i in range(batch):
        generator = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, vocab, (PROMPT_LEN + generated,), generator=generator).tolist()
        knobs: dict[str, object] = {}
        if kind in ("bias", "greedy+all", "sampled+all"):
            knobs["logit_bias"] = {t: 1.0 for t in tokens[:10]}
        if kind in ("penalties", "greedy+all", "sampled+all"):
            knobs.update(presence_penalty=0.5, frequency_penalty=0.5)
        if kind in ("sampled+min_p", "sampled+all"):
            knobs["min_p"] = 0.05
        if kind == "allowed":
            knobs["allowed_token_ids"] = tokens[:64]
        if kind == "bad_words":  # 10 words: 5 of one token, 5 of two (one of them matching)
            knobs["bad_words_ids"] = [[t] for t in tokens[:5]] + [
                [tokens[-1], tokens[j]] for j in range(5)
            ]
        if kind.startswith("sampled"):
            knobs.update(is_greedy=False, temperature=0.8, top_p=0.95)
        rows.append(
            RowParams(penalty_token_ids=tokens, num_prompt_tokens=PROMPT_LEN, **knobs)  # type: ignore[arg-type]
        )
    return rows


KINDS = [
    "greedy",
    "bias",
    "penalties",
    "greedy+all",
    "allowed",
    "bad_words",
    "sampled",
    "sampled+min_p",
    "sampled+all",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary")
    parser.add_argument("--generated", type=int, default=128, help="tokens generated so far")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {args.threads}, vocabulary {args.vocab}, {args.generated} generated")
    for batch in args.batches:
        logits = torch.randn(batch, args.vocab) * 3.0
        rows = {kind: _rows(kind, batch, args.vocab, args.generated) for kind in KINDS}
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(5):  # warm-up
            for kind in KINDS:
                sample(logits, rows[kind])
        for _ in range(args.steps):
            for kind in KINDS:
                start = time.perf_counter()
                sample(logits, rows[kind]).tolist()
                times[kind].append((time.perf_counter() - start) * 1e3)
        print(f"batch {batch}:")
        for kind in KINDS:
            median, best = statistics.median(times[kind]), min(times[kind])
            print(f"  {kind:14s} median {median:7.3f} ms   min {best:7.3f} ms")


if __name__ == "__main__":
    main()
