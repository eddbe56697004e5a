"""GGUF files written by llama.cpp's own converter (``convert_hf_to_gguf.py`` from the
llama-cpp-python sdist, through ``harness.llama_cpp``) load into the engine and give the
tokens transformers gives on the Hugging Face folder they were converted from; the tokenizer
converted from such a file (with the file's chat template) is kept, and the kept one tokenizes
as the conversion does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, PreTrainedModel

from harness import llama_cpp
from protocol.generation import GenerationConfig
from server.continuous_batching import engine as cb_engine
from server.continuous_batching.engine import LLMEngine, gguf_tokenizer
from server.continuous_batching.model.gguf_file import GGUFFile
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import engine_config
from tests.support.tiny_checkpoints import VOCAB_SIZE, write_tiny_checkpoint

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 2683, 253, 29412, 28, 9637]]
NUM_NEW_TOKENS = 12


def hf_greedy(model: PreTrainedModel, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (float32, no eos stop)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path):
    """A tiny random llama (GQA, untied) saved as HF, then converted to an f32 GGUF."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = write_tiny_checkpoint(config, folder, default_model_path)
    gguf = llama_cpp.convert_hf_to_gguf(folder, folder / "tiny-f32.gguf", outtype="f32")
    return model, gguf


def test_llama_cpp_converted_gguf_gives_transformers_tokens(converted) -> None:
    model, gguf = converted
    config = engine_config(gguf, num_blocks=64, num_blocks_cpu=0)
    engine = LLMEngine(config, runner=ModelRunner(config))
    # llama.cpp's converter permutes q/k rows; the loader must undo it exactly.
    results = engine.generate(PROMPTS, [GenerationConfig(max_new_tokens=NUM_NEW_TOKENS)] * 2)
    ours = [[t for d in deltas for t in d.token_ids] for deltas in results]
    assert ours == [hf_greedy(model, p) for p in PROMPTS]


def test_gguf_tokenizer_is_converted_once(
    converted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer transformers converts from the GGUF is kept: the second start loads the
    saved one, which encodes, decodes and templates exactly as the conversion does."""
    _, gguf = converted
    root, options = tmp_path / "cache", {"local_files_only": True}
    first = gguf_tokenizer(gguf, root, options)
    assert len(list((root / "tokenizers").iterdir())) == 1
    convert = cb_engine.AutoTokenizer.from_pretrained

    def no_conversion(*args: Any, **kwargs: Any) -> Any:
        assert "gguf_file" not in kwargs, "converted again although the cache holds it"
        return convert(*args, **kwargs)

    monkeypatch.setattr(cb_engine.AutoTokenizer, "from_pretrained", no_conversion)
    second = gguf_tokenizer(gguf, root, options)
    texts = ["The capital of France is", " héllo\n\n  wörld 123 <|im_end|>", "a" * 50]
    for text in texts:
        ids = first.encode(text)
        assert second.encode(text) == ids
        assert second.decode(ids) == first.decode(ids)
    assert (second.bos_token_id, second.eos_token_id) == (first.bos_token_id, first.eos_token_id)
    # The file's own template (which transformers' conversion leaves out): the default model's.
    assert first.chat_template == GGUFFile(gguf).value("tokenizer.chat_template")
    assert "<|im_start|>" in first.chat_template
    chat = [{"role": "user", "content": "Hi"}]
    kwargs = {"tokenize": False, "add_generation_prompt": True}
    assert second.apply_chat_template(chat, **kwargs) == first.apply_chat_template(chat, **kwargs)
