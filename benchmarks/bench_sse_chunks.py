"""Micro-benchmark: encoding one streamed chat chunk, pydantic model per event vs ``ChunkEncoder``.

    .venv/bin/python -m benchmarks.bench_sse_chunks --num-events 20000

Prints microseconds per event for both ways and their ratio (same process, alternating rounds).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from protocol.openai_api import (
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatDelta,
)
from utils.sse import ChunkEncoder, encode_event


def _per_event_us(encode: Callable[[], bytes], num_events: int) -> float:
    start = time.perf_counter()
    for _ in range(num_events):
        encode()
    return (time.perf_counter() - start) / num_events * 1e6


def main() -> None:
    """Time both encoders and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-events", type=int, default=20000, help="events per round")
    parser.add_argument("--num-rounds", type=int, default=3, help="alternating rounds")
    args = parser.parse_args()
    envelope = ChatCompletionChunk(id="chatcmpl-0123456789abcdef", model="SmolLM2", choices=[])
    encoder = ChunkEncoder(envelope)

    def with_models() -> bytes:
        choice = ChatCompletionChunkChoice(index=0, delta=ChatDelta(content=" Paris"))
        return encode_event(
            ChatCompletionChunk(id=envelope.id, model=envelope.model, choices=[choice])
        )

    def with_encoder() -> bytes:
        choice = {
            "index": 0,
            "delta": {"role": None, "content": " Paris"},
            "finish_reason": None,
            "logprobs": None,
        }
        return encoder.encode([choice])

    models_us: list[float] = []
    encoder_us: list[float] = []
    for _ in range(args.num_rounds):
        models_us.append(_per_event_us(with_models, args.num_events))
        encoder_us.append(_per_event_us(with_encoder, args.num_events))
    best_models, best_encoder = min(models_us), min(encoder_us)
    print(f"pydantic chunk per event: {best_models:.2f} us (rounds: {models_us})")
    print(f"ChunkEncoder per event:   {best_encoder:.2f} us (rounds: {encoder_us})")
    print(f"ratio: {best_models / best_encoder:.1f}x")


if __name__ == "__main__":
    main()
