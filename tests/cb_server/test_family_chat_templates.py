"""Chat templates and stop tokens of the families whose templates differ most from ChatML,
served by a CB server and asked through the ``openai`` SDK: Gemma (``model`` turns, a template
that refuses system messages and non-alternating roles) and Mistral/Mixtral (``[INST]``
turns). Each tiny checkpoint's ``generation_config.json`` lists two EOS ids; the second is a
token the greedy answer reaches, and the answer must stop there."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.served_engine import served_checkpoint
from tests.support.tiny_checkpoints import TINY_FAMILIES, write_tiny_checkpoint
from tests.support.tiny_families import hf_greedy_tokens

#: The structure of Gemma 2's template (Gemma 3's differs in folding a system message into the
#: first user turn, which this one refuses instead).
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
#: The structure of Mistral's and Mixtral's v1 template.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
TEMPLATES = {"gemma3": GEMMA_TEMPLATE, "mixtral": MISTRAL_TEMPLATE}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NUM_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def served(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_path: Path,
) -> Iterator[tuple[str, openai.OpenAI, list[int], int]]:
    """(family, an SDK client of its server, the templated question's ids, the stop id)."""
    family = request.param
    folder = tmp_path_factory.mktemp(f"template_{family}")
    config = TINY_FAMILIES[family]()
    # A tiny Gemma with tied (sqrt(hidden)-scaled) embeddings only repeats the prompt's last
    # token; untied, its greedy answer varies, so a stop token can come mid-answer.
    config.tie_word_embeddings = False
    write_tiny_checkpoint(config, folder, default_model_path)
    (folder / "chat_template.jinja").write_text(TEMPLATES[family])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if not isinstance(prompt, list) else prompt)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = hf_greedy_tokens(hf, prompt, NUM_NEW_TOKENS)
    # The second EOS id: a token the answer reaches after a few others, first seen there.
    stop_at = next(i for i, t in enumerate(expected) if i >= 3 and t not in expected[:i])
    eos_ids = [int(tokenizer.eos_token_id), expected[stop_at]]
    generation = {"bos_token_id": 1, "eos_token_id": eos_ids}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    with served_checkpoint(folder, family) as server:
        url = f"{server.url}/v1"
        with openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60) as sdk:
            yield family, sdk, prompt, stop_at + 1


def test_the_answer_stops_at_the_second_eos_id(
    served: tuple[str, openai.OpenAI, list[int], int],
) -> None:
    family, sdk, prompt, num_until_stop = served
    completion = sdk.chat.completions.create(
        model=family, messages=QUESTION, max_tokens=NUM_NEW_TOKENS, temperature=0
    )
    assert completion.usage is not None
    # The server rendered the template as transformers does.
    assert completion.usage.prompt_tokens == len(prompt)
    assert completion.usage.completion_tokens == num_until_stop
    assert completion.choices[0].finish_reason == "stop"


#: Per family: conversations its template refuses, and words of the template's reason.
REFUSED = {
    "gemma3": [
        ([{"role": "system", "content": "Be brief."}, *QUESTION], "System role not supported"),
        (QUESTION * 2, "roles must alternate"),
    ],
    "mixtral": [([*QUESTION, {"role": "tool", "content": "42"}], "Only user and assistant")],
}


def test_turns_the_template_refuses_are_400s_naming_why(
    served: tuple[str, openai.OpenAI, list[int], int],
) -> None:
    family, sdk, _, _ = served
    for messages, reason in REFUSED[family]:
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model=family, messages=messages, max_tokens=2)  # type: ignore[arg-type]
        assert reason in info.value.message
