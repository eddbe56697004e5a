"""A fake model server as a program, for a test host: ``python -m tests.multihost.fake_host``.

It serves ``tests.gateway.fake_model_server``'s app on the host's own address, announcing the
real default model's id so that the gateway balances between it and the real CB server; its
streams are slow enough (``--events`` x ``--delay``) that a fault can catch one mid-answer.
"""

from __future__ import annotations

import argparse

import uvicorn

from tests.gateway.fake_model_server import FakeServerSettings, build_fake_app


def main() -> None:
    """Parse the options and serve until SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True, help="answers start with [name]")
    parser.add_argument("--model", required=True)
    parser.add_argument("--kind", default="continuous_batching")
    parser.add_argument("--events", type=int, default=8)
    parser.add_argument("--delay", type=float, default=0.05)
    args = parser.parse_args()
    settings = FakeServerSettings(
        model_id=args.model,
        name=args.name,
        kind=args.kind,
        num_stream_events=args.events,
        stream_delay_seconds=args.delay,
    )
    uvicorn.run(build_fake_app(settings), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
