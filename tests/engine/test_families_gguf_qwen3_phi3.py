"""Qwen3 and Phi-3 from GGUF files: the config read from the metadata is the Hugging Face
folder's, the tensors are the folder's under their names, and the engine running from the GGUF
gives transformers' greedy tokens (float32).

Both GGUF files are written by llama.cpp's own converter (``harness.llama_cpp``: the
llama-cpp-python sdist's ``convert_hf_to_gguf.py``). The Phi-3 one (LongRoPE, partial rotary
factor 0.75) has its tokenizer declared ``GPT2Tokenizer``, as Phi-4-mini's is: the converter
then takes the BPE vocabulary instead of asking for Phi-3's sentencepiece ``tokenizer.model``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from harness import llama_cpp
from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.model.rotary import rope_frequencies
from server.continuous_batching.model.weights import iter_safetensors, read_arch_config
from server.continuous_batching.model.weights_gguf import iter_gguf, open_gguf, read_gguf_config
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.engine.conftest import assert_no_leak, tokens_of
from tests.engine.test_families_qwen3_phi3 import TEXTS, build_family, phi3
from tests.support.default_model import engine_config
from tests.support.tiny_families import PHI3_TEMPLATE, hf_greedy_tokens, save_checkpoint

NUM_NEW = 24


@dataclasses.dataclass
class Converted:
    """A tiny checkpoint folder, its GGUF file and transformers' greedy tokens."""

    folder: Path
    gguf: Path
    prompts: list[list[int]]
    expected: list[list[int]]


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory, default_model_path: Path) -> Converted:
    torch.manual_seed(0)
    hf = phi3(longrope=True).eval()
    folder = tmp_path_factory.mktemp("phi3_gguf")
    save_checkpoint(hf, folder, default_model_path, PHI3_TEMPLATE, [2])
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = [tokenizer(t).input_ids for t in TEXTS[:3]]
    expected = [hf_greedy_tokens(hf, p, NUM_NEW) for p in prompts]
    tokenizer_config = folder / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({**settings, "tokenizer_class": "GPT2Tokenizer"}))
    gguf = llama_cpp.convert_hf_to_gguf(folder, folder / "tiny-f32.gguf", outtype="f32")
    return Converted(folder, gguf, prompts, expected)


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory, default_model_path: Path) -> Converted:
    folder = tmp_path_factory.mktemp("qwen3_gguf")
    family = build_family("qwen3_tied", folder, default_model_path)
    gguf = llama_cpp.convert_hf_to_gguf(folder, folder / "tiny-f32.gguf", outtype="f32")
    return Converted(folder, gguf, family.prompts[:3], family.expected[:3])


def assert_same_as_folder(converted: Converted) -> None:
    """GGUF config and tensors against the Hugging Face folder's."""
    reader = open_gguf(converted.gguf)
    ours, folder = read_gguf_config(reader), read_arch_config(converted.folder)
    # float32 metadata: eps 1e-6 comes back rounded; LongRoPE's attention factor is explicit.
    assert ours.rms_norm_eps == pytest.approx(folder.rms_norm_eps, rel=1e-6)
    same = {"rms_norm_eps": folder.rms_norm_eps, "rope_scaling": folder.rope_scaling}
    assert dataclasses.replace(ours, **same) == folder
    freqs, expected = rope_frequencies(ours), rope_frequencies(folder)
    torch.testing.assert_close(freqs.inv_freq, expected.inv_freq, rtol=1e-6, atol=0)
    if expected.long_inv_freq is not None:
        torch.testing.assert_close(freqs.long_inv_freq, expected.long_inv_freq, rtol=1e-6, atol=0)
    assert freqs.attention_factor == pytest.approx(expected.attention_factor, rel=1e-6)
    tensors = dict(iter_gguf(reader, ours))
    reference = dict(iter_safetensors(converted.folder))
    if ours.tie_word_embeddings:
        reference.pop("lm_head.weight", None)
    assert sorted(tensors) == sorted(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(tensors[name], tensor.float(), rtol=0, atol=0, msg=name)


def assert_engine_matches(converted: Converted) -> None:
    """The engine from the GGUF (tokenizer and EOS ids from the folder) gives transformers'
    greedy tokens, batched."""
    config = engine_config(converted.gguf, num_blocks=64, num_blocks_cpu=0)
    config.model_loading_config.tokenizer_name_or_path = str(converted.folder)
    engine = LLMEngine(config, runner=ModelRunner(config))
    configs = [GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True)] * len(converted.prompts)
    results = engine.generate(converted.prompts, configs)
    assert [tokens_of(r)[0] for r in results] == converted.expected
    assert_no_leak(engine)


def test_phi3_gguf_reads_as_the_folder(phi3_gguf: Converted) -> None:
    config = read_gguf_config(open_gguf(phi3_gguf.gguf))
    assert (config.family, config.rotary_dim, config.rope_scaling["rope_type"]) == (
        "phi3",
        12,
        "longrope",
    )
    assert_same_as_folder(phi3_gguf)


def test_phi3_gguf_engine_matches_transformers(phi3_gguf: Converted) -> None:
    assert_engine_matches(phi3_gguf)


def test_qwen3_gguf_from_llama_cpp_reads_as_the_folder(qwen3_gguf: Converted) -> None:
    reader = open_gguf(qwen3_gguf.gguf)
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= names
    assert read_gguf_config(reader).family == "qwen3"
    # Unpermuted q/k: llama.cpp runs Qwen with rotate-half RoPE, our layout.
    assert_same_as_folder(qwen3_gguf)


def test_qwen3_gguf_from_llama_cpp_engine_matches_transformers(qwen3_gguf: Converted) -> None:
    assert_engine_matches(qwen3_gguf)
