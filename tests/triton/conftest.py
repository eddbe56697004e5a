"""The Triton tests' session-wide fixtures: one PyTriton server and the chat prompt it gets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.default_model import DEMO_QUESTION
from tests.triton.triton_server import TritonServer, start_triton_server


@pytest.fixture(scope="session")
def triton(
    default_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """A real Triton server (PyTriton, transformers) over the default model, started once per
    session: raw text prompts, Triton model name "ensemble", as TensorRT-LLM takes them."""
    server = start_triton_server(default_model_path, tmp_path_factory.mktemp("triton"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def chat_prompt(default_model_path: Path) -> str:
    """The demo question rendered with the model's chat template (Triton applies none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": DEMO_QUESTION}], tokenize=False, add_generation_prompt=True
    )
