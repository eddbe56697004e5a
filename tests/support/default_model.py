"""The default model as the tests use it: its served id, the demo question, an engine config.

The model itself (its folder, loaded once per session) comes from the fixtures in
``tests/conftest.py``; these are the plain values around it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol.generation import GenerationConfig
from server.continuous_batching.engine_config import EngineConfig

#: The question the demo, the chat page and the Triton tests ask.
DEMO_QUESTION = "What is the capital of France?"

MODEL_ID = "SmolLM2-135M-Instruct"


def chat_body(content: str, **fields: object) -> dict[str, object]:
    """A chat request body for the default model: one user message, then ``fields``."""
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], **fields}


def engine_config(model_path: Path, **cache: object) -> EngineConfig:
    """A CB engine config over ``model_path`` (float32) with optional cache overrides."""
    return EngineConfig.model_validate(
        {
            "model_loading_config": {
                "model_name_or_path": str(model_path),
                "torch_dtype": "float32",
            },
            "batcher_config": {"batch_max_tokens": 512, "batch_max_beams": 64},
            "cache_config": {"num_blocks": 1024, "num_blocks_cpu": 256, "block_size": 16, **cache},
        }
    )


def greedy_tokens(
    runner: Any, model_path: Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """The token ids a fresh CB engine over ``runner`` (a loaded ``ModelRunner``, shared to
    spare loading the model again) generates greedily for each prompt."""
    from server.continuous_batching.engine import LLMEngine

    engine = LLMEngine(engine_config(model_path), runner=runner)
    configs = [GenerationConfig(max_new_tokens=max_new_tokens)] * len(prompts)
    results = engine.generate(prompts, configs)
    return [[t for d in deltas for t in d.token_ids] for deltas in results]


def assert_answers_the_demo_question(base_url: str, timeout: float = 120.0) -> None:
    """POST the demo question to ``base_url``'s OpenAI chat endpoint (greedy) and check that
    the default model names Paris."""
    import httpx

    answer = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={
            "model": MODEL_ID,
            "messages": [{"role": "user", "content": DEMO_QUESTION}],
            "temperature": 0,
            "max_tokens": 24,
        },
        timeout=timeout,
    )
    assert answer.status_code == 200, answer.text
    assert "Paris" in answer.json()["choices"][0]["message"]["content"]


def assert_still_serves(base_url: str) -> None:
    """A short ``/generate`` at ``base_url`` answers 200: bad requests did not break it."""
    import httpx

    body = {"prompt": "Hi", "generation_config": {"max_new_tokens": 2}}
    assert httpx.post(f"{base_url}/generate", json=body, timeout=60).status_code == 200
