"""Ask the running gateway one chat question through its OpenAI-compatible API.

Usage::

    python -m tools.demo_chat [--url http://127.0.0.1:8000] [--model SmolLM2-135M-Instruct]
                              [--question "What is the capital of France?"]

Start the apps first with ``python start_app.py up`` (``make demo`` does both).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx

DEFAULT_URL: str = "http://127.0.0.1:8000"
DEFAULT_MODEL: str = "SmolLM2-135M-Instruct"
DEFAULT_QUESTION: str = "What is the capital of France?"


def chat_request_body(model: str, question: str, max_tokens: int = 64) -> dict[str, Any]:
    """The request body of the demo: one user message, greedy decoding."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }


def ask(url: str, model: str, question: str, timeout: float = 300.0) -> str:
    """POST the question to ``url``/v1/chat/completions and return the answer text.

    Raises ``httpx.HTTPError`` on transport errors and ``RuntimeError`` on an error answer.
    """
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    # trust_env=False: a proxy from the environment must not intercept a loopback call.
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        response = client.post(endpoint, json=chat_request_body(model, question))
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code} from {endpoint}: {response.text[:500]}")
    data = response.json()
    try:
        return str(data["choices"][0]["message"]["content"]).strip()
    except (KeyError, IndexError, TypeError):
        raise RuntimeError(f"unexpected answer from {endpoint}: {json.dumps(data)[:500]}") from None


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.demo_chat",
        description="Send one chat question to the gateway and print the answer.",
    )
    parser.add_argument("--url", default=DEFAULT_URL, help=f"gateway URL (default {DEFAULT_URL})")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    parser.add_argument("--question", default=DEFAULT_QUESTION, help="the question to ask")
    args = parser.parse_args(argv)

    print(f"Q: {args.question}", flush=True)
    start = time.perf_counter()
    try:
        answer = ask(args.url, args.model, args.question)
    except httpx.ConnectError:
        print(
            f"error: the gateway at {args.url} is not reachable. "
            "Start the apps first: python start_app.py up",
            file=sys.stderr,
        )
        return 1
    except httpx.TimeoutException:
        print(f"error: the gateway at {args.url} did not answer in time", file=sys.stderr)
        return 1
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"A: {answer}")
    print(f"({time.perf_counter() - start:.2f} s via {args.url})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
