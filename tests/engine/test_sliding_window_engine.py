"""The engine on tiny random sliding-window models against transformers float32, token for
token, with generations well past the window: Mistral (every layer slides; out-of-window
blocks are freed) and Qwen2 with ``use_sliding_window`` (full layers below
``max_window_layers``: nothing is freed). Each runs on the torch reference path and at every
CPU ISA level with the fused kernels, batched, with prompts split over steps (chunked
prefill). The Triton decode kernel's run is in ``test_triton_sliding_window``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, PreTrainedModel, Qwen2Config
from transformers import Qwen2ForCausalLM as HFQwen2

from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.engine_config import EngineConfig
from server.continuous_batching.scheduling.block_manager import NULL_BLOCK
from tests.engine.conftest import assert_no_leak
from tests.support.cpu_paths import kernel_levels

WINDOW = 8
BLOCK_SIZE = 4
NUM_NEW = 20
PROMPT_LENS = [5, 19, 30, 11]
SIZES = {
    "vocab_size": 128,
    "hidden_size": 128,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,  # the CPU kernel's vector pass
    "max_position_embeddings": 256,
}


def save_tiny(model_class: type[PreTrainedModel], config, folder: Path) -> PreTrainedModel:
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    folder = tmp_path_factory.mktemp("tiny_mistral")
    config = MistralConfig(**SIZES, sliding_window=WINDOW)
    return folder, save_tiny(MistralForCausalLM, config, folder)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    config = Qwen2Config(
        **SIZES, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    assert config.layer_types == ["full_attention", "sliding_attention"]
    return folder, save_tiny(HFQwen2, config, folder)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def hf_greedy(hf: PreTrainedModel, prompt: list[int], num_new: int) -> list[int]:
    """transformers' greedy tokens, each from a full forward (its sliding-window masks)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_new):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def tiny_engine(
    path: Path, tokenizer_path: Path, level: str | None, num_blocks: int = 64
) -> LLMEngine:
    """A float32 engine with 4-token blocks and a 16-token step budget (prompts over 16 tokens
    run in chunks); ``level``: a CPU ISA level with its kernels, None: the torch path."""
    loading = {
        "model_name_or_path": str(path),
        "tokenizer_name_or_path": str(tokenizer_path),
        "torch_dtype": "float32",
        "cpu_kernels": level is not None,
        "cpu_isa": level or "auto",
    }
    config = EngineConfig.model_validate(
        {
            "model_loading_config": loading,
            "batcher_config": {"batch_max_tokens": 16, "batch_max_beams": 8},
            "cache_config": {
                "block_size": BLOCK_SIZE,
                "num_blocks": num_blocks,
                "num_blocks_cpu": 8,
            },
        }
    )
    return LLMEngine(config)


def engine_greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    config = GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True)
    results = engine.generate(prompts, [config] * len(prompts))
    return [[t for d in deltas for t in d.token_ids] for deltas in results]


@pytest.fixture(scope="module")
def mistral_tokens(mistral, prompts) -> list[list[int]]:
    """transformers' windowed greedy tokens, checked to differ from full attention's (with
    the same weights) so that the comparisons below can tell the window is applied."""
    path, hf = mistral
    expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    full = MistralForCausalLM(MistralConfig(**SIZES, sliding_window=None)).eval()
    full.load_state_dict(hf.state_dict())
    assert all(hf_greedy(full, p, NUM_NEW) != e for p, e in zip(prompts, expected, strict=True))
    return expected


@pytest.fixture(scope="module")
def qwen2_tokens(qwen2, prompts) -> list[list[int]]:
    return [hf_greedy(qwen2[1], p, NUM_NEW) for p in prompts]


PATHS = [None, *kernel_levels()]
PATH_IDS = ["torch", *kernel_levels()]


@pytest.mark.parametrize("level", PATHS, ids=PATH_IDS)
def test_mistral_greedy_matches_transformers(
    mistral, prompts, mistral_tokens, default_model_path, level
) -> None:
    path, _ = mistral
    engine = tiny_engine(path, default_model_path, level)
    assert engine.block_manager.sliding_window == WINDOW
    if level is not None:
        assert engine.runner.model.attention_backend == "cpu"
    assert engine_greedy(engine, prompts) == mistral_tokens
    assert_no_leak(engine)


@pytest.mark.parametrize("level", PATHS, ids=PATH_IDS)
def test_qwen2_mixed_layers_match_transformers(
    qwen2, prompts, qwen2_tokens, default_model_path, level
) -> None:
    path, _ = qwen2
    engine = tiny_engine(path, default_model_path, level)
    arch = engine.runner.arch
    assert [arch.window_of(i) for i in range(2)] == [None, WINDOW]
    assert engine.block_manager.sliding_window is None  # a full layer needs every block
    assert engine_greedy(engine, prompts) == qwen2_tokens
    assert_no_leak(engine)


def test_long_sequence_holds_bounded_blocks(mistral, default_model_path) -> None:
    # 6 + 60 tokens need 17 blocks in full; with the window the sequence never holds more
    # than ceil(window / block) + 1 = 3 (measured while each step runs), in an 8-block pool.
    path, hf = mistral
    engine = tiny_engine(path, default_model_path, None, num_blocks=8)
    peaks: list[int] = []
    execute = engine.runner.execute

    def counting_execute(plan):
        live = [b for item in plan.scheduled for b in item.seq.block_table if b != NULL_BLOCK]
        used = engine.block_manager.device.num_blocks - engine.block_manager.device.num_free
        peaks.append(max(len(live), used))
        return execute(plan)

    engine.runner.execute = counting_execute
    prompt = list(range(3, 9))
    config = GenerationConfig(max_new_tokens=60, ignore_eos=True)
    (deltas,) = engine.generate([prompt], [config])
    assert [t for d in deltas for t in d.token_ids] == hf_greedy(hf, prompt, 60)
    assert len(peaks) == 60 and max(peaks) == -(-WINDOW // BLOCK_SIZE) + 1
    assert_no_leak(engine)
