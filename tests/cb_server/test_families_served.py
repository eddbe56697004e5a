"""Every model family the engine runs, served end to end: a CB server over a tiny random
checkpoint of the family, a gateway in front, the ``openai`` SDK asking a chat question; the
answer is transformers' greedy answer on the same checkpoint, through the same chat template."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer

from harness.servers import gateway_served
from tests.support.served_engine import served_checkpoint
from tests.support.tiny_checkpoints import TINY_FAMILIES, write_tiny_checkpoint

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NUM_NEW_TOKENS = 10


@pytest.fixture(scope="module", params=sorted(TINY_FAMILIES))
def family_served(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_path: Path,
) -> Iterator[tuple[str, str, Path]]:
    """(family, the gateway's URL, the checkpoint folder) for each family."""
    family = request.param
    folder = tmp_path_factory.mktemp(f"tiny_{family}")
    write_tiny_checkpoint(TINY_FAMILIES[family](), folder, default_model_path)
    with served_checkpoint(folder, family) as server:
        for gateway in gateway_served(
            tmp_path_factory.mktemp("gateway"), continuous_batching_server_urls=[server.url]
        ):
            yield family, gateway.url, folder


def transformers_answer(folder: Path) -> str:
    """transformers' greedy answer to MESSAGES (float32, the checkpoint's chat template)."""
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    out = model.generate(ids, max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_the_sdk_gets_transformers_greedy_answer(family_served: tuple[str, str, Path]) -> None:
    family, url, folder = family_served
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    with sdk:
        completion = sdk.chat.completions.create(
            model=family,
            messages=MESSAGES,
            max_tokens=NUM_NEW_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert completion.model == family
    assert completion.choices[0].message.content == transformers_answer(folder)
