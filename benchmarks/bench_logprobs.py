"""What logprobs cost per decode step: the CB sampler's token choice and read-back for a batch
of greedy rows, none asking for logprobs, and every row asking for its token's logprob and the
top 5 (raw mode).

The script times :class:`server.continuous_batching.sampling.sampler.LogitsSampler`'s ``sample``
plus ``read_tokens`` (the step's one device-to-host copy, which carries the logprobs too) on random
logits of the default model's width (49152) at each batch size, and prints the medians as JSON.

Run: ``.venv/bin/python -m benchmarks.bench_logprobs [--batches 1 32] [--steps 40] [--top 5]
[--threads 1]``
"""

from __future__ import annotations

import json

import torch

from benchmarks import median_step_ms, step_bench_parser
from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.sampling.sampler import LogitsSampler

VOCAB_SIZE = 49152


def _time_steps(num_rows: int, num_steps: int, top: int | None) -> float:
    """Median milliseconds of one ``sample`` + ``read_tokens`` (+ ``read_logprobs``)."""
    sampler = LogitsSampler()
    rows = [RowParams(logprobs=top) for _ in range(num_rows)]
    row_index = list(range(num_rows))

    def step(_: int, logits: torch.Tensor) -> None:
        handle = sampler.sample(logits, row_index, rows)
        sampler.read_tokens(handle)
        if top is not None:
            sampler.read_logprobs(handle)

    return median_step_ms(num_steps, lambda _: torch.randn(num_rows, VOCAB_SIZE), step)


def main() -> None:
    parser = step_bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=5)
    # On a shared machine torch's thread pool waits for busy cores (some 8 ms an op here
    # while other work ran); one thread measures the ops themselves.
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for num_rows in args.batches:
        plain = _time_steps(num_rows, args.steps, None)
        asking = _time_steps(num_rows, args.steps, args.top)
        results.append(
            {
                "batch": num_rows,
                "plain_ms": round(plain, 3),
                "logprobs_ms": round(asking, 3),
                "extra_ms": round(asking - plain, 3),
            }
        )
    print(json.dumps({"top": args.top, "vocab": VOCAB_SIZE, "results": results}, indent=2))


if __name__ == "__main__":
    main()
