"""A CB server (in a thread of the test process) over a checkpoint folder, for tests that ask
it over HTTP: a small float32 engine, the model served under one name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from harness.servers import ServerThread
from server.common.app import create_server_app
from server.common.service import ServingSettings
from server.continuous_batching.async_engine import AsyncEngine
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import engine_config


@contextlib.contextmanager
def served_checkpoint(folder: Path, name: str) -> Iterator[ServerThread]:
    """The started server over ``folder`` as model ``name`` (64 KV blocks, no swap space);
    stopped on exit."""
    config = engine_config(folder, num_blocks=64, num_blocks_cpu=0)
    engine = LLMEngine(config, runner=ModelRunner(config))
    settings = ServingSettings(served_model_names=[name], default_max_new_tokens=8)
    server = ServerThread(create_server_app(AsyncEngine(engine, name), settings))
    server.start(timeout_seconds=60)
    try:
        yield server
    finally:
        server.stop()
