"""Ask the running gateway one chat question through its OpenAI-compatible API.

Usage::

    python -m tools.demo_chat [--deployment configs/deployment.json] [--url URL]
                              [--model SmolLM2-135M-Instruct]
                              [--question "What is the capital of France?"]

The gateway's address comes from the deployment file (its enabled ``client`` app) unless
``--url`` names one; so do the chat page's address and the stop hint printed after the answer.
Start the apps first with ``python start_app.py up`` (``make demo`` does both).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from launcher.console import StartAppError
from launcher.deployment import DEFAULT_DEPLOYMENT, Deployment, base_url, load_deployment

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


def app_url(deployment: Deployment, role: str) -> str | None:
    """The URL of the deployment's first enabled app of ``role`` (``gateway``, ``ui``)."""
    for entry in deployment.apps:
        if entry.enabled and entry.role == role:
            return base_url(entry.host, entry.port)
    return None


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.demo_chat",
        description="Send one chat question to the gateway and print the answer.",
    )
    parser.add_argument(
        "--deployment",
        default=str(DEFAULT_DEPLOYMENT),
        help="deployment file giving the gateway's address (default: %(default)s)",
    )
    parser.add_argument("--url", help="gateway URL (default: the deployment's client app)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    parser.add_argument("--question", default=DEFAULT_QUESTION, help="the question to ask")
    args = parser.parse_args(argv)
    deployment: Deployment | None = None
    if args.url is None:
        try:
            deployment = load_deployment(args.deployment)
        except StartAppError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        args.url = app_url(deployment, "gateway")
        if args.url is None:
            print(f"error: {args.deployment} enables no client (gateway) app", file=sys.stderr)
            return 2

    print(f"Q: {args.question}", flush=True)
    start = time.perf_counter()
    try:
        answer = ask(args.url, args.model, args.question)
    except httpx.ConnectError:
        print(
            f"error: nothing answers at {args.url} (the gateway's address"
            f"{' in ' + args.deployment if deployment else ''}). Is it up? "
            "See: python start_app.py status",
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
    if deployment is not None:
        _print_next_steps(deployment, args.deployment)
    return 0


def _print_next_steps(deployment: Deployment, path: str) -> None:
    """Where the chat page is and how to stop, for the deployment that answered."""
    print()
    ui_url = app_url(deployment, "ui")
    if ui_url is not None:
        print(f"Chat in a browser: {ui_url}")
    stop = "python start_app.py down"
    if Path(path).resolve() != DEFAULT_DEPLOYMENT.resolve():
        stop += f" --deployment {path}"
    print(f"The apps keep running in the background. Stop them with:  {stop}")


if __name__ == "__main__":
    sys.exit(main())
