"""A small CB server over the session's model, shared by the tests of this folder that need
no special settings (modules may define their own ``cb_server``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from harness.servers import ServerThread, gateway_served
from server.common.app import create_server_app
from server.common.service import ServingSettings
from server.continuous_batching.async_engine import AsyncEngine
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import MODEL_ID, engine_config


@pytest.fixture(scope="module")
def cb_server(default_model_path: Path, cb_runner: ModelRunner) -> Iterator[ServerThread]:
    """A CB server (64 blocks, 8 new tokens by default) over the shared model."""
    engine = LLMEngine(engine_config(default_model_path, num_blocks=64), runner=cb_runner)
    settings = ServingSettings(served_model_names=[MODEL_ID], default_max_new_tokens=8)
    server = ServerThread(create_server_app(AsyncEngine(engine, MODEL_ID), settings))
    yield server.start(timeout_seconds=60)
    server.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, cb_server: ServerThread) -> Iterator[Any]:
    """A gateway in front of this module's CB server."""
    folder = tmp_path_factory.mktemp("gateway")
    yield from gateway_served(folder, continuous_batching_server_urls=[cb_server.url])


@pytest.fixture(scope="module")
def client(gateway: ServerThread) -> Iterator[Any]:
    """The ``openai`` SDK on that gateway (no retries: a failure shows as it is)."""
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=120)
    yield sdk
    sdk.close()
