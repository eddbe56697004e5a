"""Split py-spy raw profiles of the serving stack into layers, per streamed token.

    .venv/bin/python -m benchmarks.spy_breakdown /tmp/serving_cpu/after_r2

reads ``gw.raw``, ``cb.raw`` and ``cpu.json`` written by ``benchmarks/serving_cpu.sh`` and
prints, for each layer, the sampled Python thread time per streamed token (py-spy samples at
200 Hz; one sample = 5 ms of one thread running) and its share of the busy samples. Samples
whose innermost Python frame is the event loop waiting (asyncio's selector; under uvloop its C
loop, seen as ``Runner.run``, which also hides uvloop's own C work) are counted apart.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

SAMPLES_PER_SECOND = 200.0
LOOP_WAIT = "event loop wait (epoll; uvloop: its C loop)"
LOOP_WAIT_LEAVES = ("EpollSelector.select", "Runner.run", "BaseEventLoop.run_forever")


def _is_loop_wait(frames: list[str]) -> bool:
    return frames[-1].startswith(LOOP_WAIT_LEAVES)


def server_layer(frames: list[str]) -> str:
    """The layer of one CB server stack (first frame: the thread, from ``--threads``)."""
    stack = ";".join(frames)
    if "MainThread" not in frames[0]:
        if "_hand_off" in stack or "_deliver" in stack or "call_soon_threadsafe" in stack:
            return "hand-off, engine thread side (wake the loop)"
        if "Decoder._append" in stack or "IncrementalDetokenizer" in stack:
            return "detokenisation + stop strings"
        if "LLMEngine.step" in stack:
            return "engine step (schedule, forward, sample)"
        return "engine thread, other (commands, wait)"
    if _is_loop_wait(frames):
        return LOOP_WAIT
    if "_distribute" in stack or "AsyncEngine.stream" in stack:
        return "hand-off, event loop side (queues)"
    if "PromptProcessor" in stack or "render_chat" in stack:
        return "request intake (chat template, tokenizer)"
    return "HTTP/SSE layer (routes, chunks, middleware, uvicorn)"


def gateway_layer(frames: list[str]) -> str:
    """The layer of one gateway stack."""
    stack = ";".join(frames)
    if _is_loop_wait(frames):
        return LOOP_WAIT
    if any(k in stack for k in ("aiter_bytes", "aiter_raw", "httpcore", "_send_single_request")):
        return "upstream: request + reading chunks (httpx, httpcore, h11)"
    if "RequestResponseCycle.send" in stack or "StreamingResponse" in stack:
        return "downstream: relay writes (starlette, uvicorn)"
    if any(k in stack for k in ("attempt.py", "intake", "failover", "gateway")):
        return "intake, routing, attempt"
    return "event loop callbacks, other"


def breakdown(path: Path, layer: Callable[[list[str]], str], has_threads: bool) -> Counter[str]:
    """Samples per layer of one raw py-spy file."""
    counts: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, num = line.rpartition(" ")
        frames = stack.split(";")
        if has_threads and not frames[0].startswith("thread"):
            frames = ["thread (?): MainThread", *frames]
        counts[layer(frames)] += int(num)
    return counts


def report(title: str, counts: Counter[str], num_tokens: int) -> None:
    """Print ms per streamed token and share of busy samples, by layer."""
    num_busy = sum(n for k, n in counts.items() if k != LOOP_WAIT)
    print(title)
    for name, num in counts.most_common():
        ms = num / SAMPLES_PER_SECOND / num_tokens * 1000
        share = "" if name == LOOP_WAIT else f"  {num / num_busy * 100:5.1f}% of busy"
        print(f"  {name:58s} {ms:7.3f} ms/token{share}")


def main() -> None:
    """Print both processes' breakdowns for one run folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder of serving_cpu.sh")
    args = parser.parse_args()
    figures = json.loads((args.run / "cpu.json").read_text())
    num_tokens = figures["num_tokens"]
    print(json.dumps(figures))
    report("gateway", breakdown(args.run / "gw.raw", gateway_layer, False), num_tokens)
    report("CB server", breakdown(args.run / "cb.raw", server_layer, True), num_tokens)


if __name__ == "__main__":
    main()
