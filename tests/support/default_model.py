"""The default model as the tests use it: its served id, the demo question, an engine config.

The model itself (its folder, loaded once per session) comes from the fixtures in
``tests/conftest.py``; these are the plain values around it.
"""

from __future__ import annotations

from pathlib import Path

from server.continuous_batching.engine_config import EngineConfig

#: The question the demo, the chat page and the Triton tests ask.
DEMO_QUESTION = "What is the capital of France?"

MODEL_ID = "SmolLM2-135M-Instruct"


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
