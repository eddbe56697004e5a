"""Serve the gateway or the CB server in the foreground with an explicit uvicorn event loop and
HTTP parser, for A/B runs of the serving stack (``benchmarks/serving_cpu.sh``)::

    .venv/bin/python -m benchmarks.run_app_with_loop cb configs/cb_server_config.json 18001 \\
        asyncio h11

The apps' own entry points serve with uvloop and ``utils.http_protocol``'s hardened httptools
protocol; either parser here is served by its hardened protocol, as deployed.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    """Build the app from the checkout in the working directory and serve it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("app", choices=["gateway", "cb"])
    parser.add_argument("config")
    parser.add_argument("port", type=int)
    parser.add_argument("loop", choices=["asyncio", "uvloop"])
    parser.add_argument("http", choices=["h11", "httptools"])
    args = parser.parse_args()
    import uvicorn

    if args.app == "gateway":
        from client_app import build_app
        from utils.logging import setup_logging

        app = build_app(args.config)
        setup_logging("warning")
    else:
        os.environ["LLM_SUITE_LOG_LEVEL"] = "WARNING"
        from continuous_batching_server_app import build_app

        app = build_app(args.config)
    from utils.serving import uvicorn_options

    options = uvicorn_options(app, args.http)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        loop=args.loop,
        log_level="warning",
        access_log=False,
        **options,
    )


if __name__ == "__main__":
    main()
