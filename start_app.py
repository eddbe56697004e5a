#!/usr/bin/env python3
"""Launch, watch and stop the suite's apps: gunicorn masters with uvicorn workers, in background.

Every app (the gateway ``client`` and the servers ``cb_server`` / ``sb_server``) runs as::

    <python> -m gunicorn "MODULE:build_app('CONFIG')" \
        --worker-class utils.serving.HardenedUvicornWorker --bind HOST:PORT --workers N \
        --timeout 600 --graceful-timeout 30 --pid RUN/NAME.pid

in a session of its own, with stdout/stderr in ``RUN/logs/NAME.log`` and a record in
``RUN/NAME.json`` so that ``down``, ``stop`` and ``status`` find it again from another shell.
The chat front end (``chat_ui``, the optional ``ui`` extra) is no ASGI app: it runs as
``<python> -m streamlit run chat_ui_app.py --server.headless true ...`` with the same pid, log
and record files; its gateway is ``$LLM_SUITE_GATEWAY_URL`` (the entry's ``env``).
``RUN`` is ``<repo>/run`` unless ``--run-dir``, the environment variable ``LLM_SUITE_RUN_DIR``
or the deployment's ``run_dir`` says otherwise (in that order of precedence).

Deployments are JSON files (``configs/deployment.json`` by default) validated by the pydantic
models in ``launcher/deployment.py``; relative paths in them are relative to the
repository root.

This file is the entry point in a source checkout; installed, the same command line is the
console script ``llm-suite`` (also ``python -m launcher``), which adds ``serve MODEL``. The
launcher itself is the package ``launcher/``.
"""

from __future__ import annotations

import sys

from launcher.cli import build_parser, main
from launcher.deployment import DEFAULT_DEPLOYMENT, ROLE_ORDER, base_url, load_deployment

# What callers import from start_app: main, and the names that read the shipped deployment.
__all__ = [
    "DEFAULT_DEPLOYMENT",
    "ROLE_ORDER",
    "base_url",
    "build_parser",
    "load_deployment",
    "main",
]


if __name__ == "__main__":
    sys.exit(main())
