"""What prompt logprobs (``echo`` with ``logprobs``) cost: a request of one generated token over
a prompt of ``--prompt-len`` tokens on the CB engine with the default model, scored
(``prompt_logprobs``: every prompt position's logits, a float32 log-softmax and a top-k) and not,
timed alternately in the same process; prints the medians and their ratio as JSON. Neither run
uses the prefix cache (it is off), so both compute the whole prompt.

Run: ``.venv/bin/python -m benchmarks.bench_prompt_logprobs [--prompt-len 128] [--runs 10]
[--top 1] [--threads 1]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.engine_config import EngineConfig
from tools.prepare_model import default_model_dir


def _engine(prompt_len: int, dtype: str) -> LLMEngine:
    config = EngineConfig.model_validate(
        {
            "model_loading_config": {
                "model_name_or_path": str(default_model_dir()),
                "torch_dtype": dtype,
            },
            "batcher_config": {"batch_max_tokens": max(512, prompt_len)},
            "cache_config": {"num_blocks": 256, "enable_prefix_caching": False},
        }
    )
    return LLMEngine(config)


def _time(engine: LLMEngine, prompt: list[int], config: GenerationConfig) -> float:
    start = time.perf_counter()
    engine.generate([prompt], [config])
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--top", type=int, default=1, help="alternatives per prompt token")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = _engine(args.prompt_len, args.dtype)
    vocab = len(engine.tokenizer)
    prompt = [(7 + 31 * i) % vocab for i in range(args.prompt_len)]
    plain = GenerationConfig(max_new_tokens=1, ignore_eos=True)
    scored = plain.model_copy(update={"prompt_logprobs": args.top})
    _time(engine, prompt, plain)  # warm-up
    _time(engine, prompt, scored)
    plain_ms, scored_ms = [], []
    for _ in range(args.runs):  # alternated, so that drifts of a shared machine hit both
        plain_ms.append(_time(engine, prompt, plain))
        scored_ms.append(_time(engine, prompt, scored))
    plain_median, scored_median = statistics.median(plain_ms), statistics.median(scored_ms)
    print(
        json.dumps(
            {
                "prompt_len": args.prompt_len,
                "top": args.top,
                "dtype": args.dtype,
                "plain_ms": round(plain_median, 2),
                "prompt_logprobs_ms": round(scored_median, 2),
                "ratio": round(scored_median / plain_median, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
