"""Gemma 2 and Gemma 3 (text) from GGUF files written by llama.cpp's own converter: the config
read from the metadata is the Hugging Face folder's, field by field; the tensors are the
folder's (norms as the converter writes them, 1 + w); the engine running from the GGUF gives
transformers' greedy tokens (float32); a Q8_0 file runs packed as it runs dequantised.

The tiny checkpoints are shaped to what a GGUF can say: ``query_pre_attn_scalar`` is head_dim
(the file does not store it; llama.cpp scales by head_dim), and Gemma 3 has six layers (the
file holds no layer types; llama.cpp's period of six makes the sixth global). Their norm
weights are random, so adding the converter's 1 a second time would show.

Gemma 3's converter reads a tokenizer.json-only folder (BPE vocabulary). Gemma 2's reads only
a sentencepiece ``tokenizer.model``, which the tiny folders lack: it runs with its
``set_vocab`` swapped for the BPE one (what its Gemma 3 sibling does), every tensor and
metadata key still its own.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import llama_cpp
from server.continuous_batching.engine_config import ModelLoadingConfig
from server.continuous_batching.model.architecture import ModelArchConfig
from server.continuous_batching.model.gemma import GemmaForCausalLM
from server.continuous_batching.model.weights import (
    iter_safetensors,
    load_model,
    read_arch_config,
)
from server.continuous_batching.model.weights_gguf import iter_gguf, open_gguf, read_gguf_config
from server.continuous_batching.model.weights_gguf_gemma import with_gguf_gemma
from server.continuous_batching.quantization.packed_linear import PackedLinear
from tests.engine.test_cb_gguf_packed import greedy
from tests.engine.test_families_gguf_qwen3_phi3 import NUM_NEW, Converted, assert_engine_matches
from tests.engine.test_families_qwen3_phi3 import TEXTS
from tests.support.cpu_paths import kernel_levels
from tests.support.tiny_checkpoints import SHAPE
from tests.support.tiny_families import QWEN3_TEMPLATE, hf_greedy_tokens, save_checkpoint

#: Tiny configs a GGUF describes fully (see the module docstring); Gemma 2's soft caps small
#: enough to change scores and logits.
CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(
        **SHAPE,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        attn_logit_softcapping=10.0,
        final_logit_softcapping=15.0,
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": 6}, head_dim=16, query_pre_attn_scalar=16, sliding_window=8
    ),
}

_GEMMA2_CONVERT = """
import runpy, sys
tree, folder, out, outtype = sys.argv[1:]
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion.gemma import Gemma2Model
Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = [tree + "/convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", outtype]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(family: str, folder: Path, out: Path, outtype: str) -> Path:
    """llama.cpp's converter on ``folder`` (Gemma 2: with the BPE vocabulary, see above)."""
    if family == "gemma3":
        return llama_cpp.convert_hf_to_gguf(folder, out, outtype=outtype)
    tree = str(llama_cpp.source_tree())
    args = [sys.executable, "-c", _GEMMA2_CONVERT, tree, str(folder), str(out), outtype]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return out


def build(family: str, folder: Path, default_model_path: Path) -> Converted:
    """A tiny random ``family`` checkpoint with random norms, converted to an f32 GGUF."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.4)
    save_checkpoint(hf, folder, default_model_path, QWEN3_TEMPLATE, [2])
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = [tokenizer(t).input_ids for t in TEXTS[:3]]
    expected = [hf_greedy_tokens(hf, p, NUM_NEW) for p in prompts]
    gguf = convert(family, folder, folder / "tiny-f32.gguf", "f32")
    return Converted(folder, gguf, prompts, expected)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def converted(request, tmp_path_factory, default_model_path: Path) -> tuple[str, Converted]:
    folder = tmp_path_factory.mktemp(f"{request.param}_gguf")
    return request.param, build(request.param, folder, default_model_path)


def test_gguf_config_is_the_folders(converted: tuple[str, Converted]) -> None:
    family, files = converted
    reader = open_gguf(files.gguf)
    ours, folder = read_gguf_config(reader), read_arch_config(files.folder)
    # float32 metadata: eps 1e-6 comes back rounded.
    assert ours.rms_norm_eps == pytest.approx(folder.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(ours, rms_norm_eps=folder.rms_norm_eps) == folder
    assert ours.family == {"gemma2": "gemma2", "gemma3": "gemma3_text"}[family]
    assert ours.tie_word_embeddings and ours.sliding_window == 8
    if family == "gemma3":
        assert ours.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
        assert (ours.rope_theta, ours.sliding_rope_theta) == (1_000_000.0, 10_000.0)
    else:
        assert (ours.attn_logit_softcap, ours.final_logit_softcap) == (10.0, 15.0)


def test_gguf_tensors_are_the_folders(converted: tuple[str, Converted]) -> None:
    """Every tensor under its Hugging Face name; the norms are the converter's 1 + w."""
    _, files = converted
    reader = open_gguf(files.gguf)
    tensors = dict(iter_gguf(reader, read_gguf_config(reader)))
    reference = dict(iter_safetensors(files.folder))
    assert sorted(tensors) == sorted(reference)
    for name, tensor in reference.items():
        expected = tensor.float() + 1 if name.endswith("norm.weight") else tensor.float()
        torch.testing.assert_close(tensors[name], expected, rtol=0, atol=0, msg=name)


def test_gguf_model_has_the_folders_weights(converted: tuple[str, Converted]) -> None:
    """Loaded from the GGUF, every weight (norms folded once) and the embedding scale equal
    the safetensors-loaded model's."""
    _, files = converted
    config = ModelLoadingConfig(model_name_or_path=str(files.gguf), torch_dtype="float32")
    config.gguf_dequantize_at_load = True
    from_gguf = load_model(config)[0]
    folder_config = ModelLoadingConfig(model_name_or_path=str(files.folder), torch_dtype="float32")
    from_folder = load_model(folder_config)[0]
    assert isinstance(from_gguf, GemmaForCausalLM)
    assert from_gguf.embed_multiplier == from_folder.embed_multiplier == 8.0
    pairs = zip(from_gguf.norm_weights(), from_folder.norm_weights(), strict=True)
    for ours, theirs in pairs:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    ours_state, theirs_state = from_gguf.state_dict(), from_folder.state_dict()
    assert sorted(ours_state) == sorted(theirs_state)
    for name, tensor in theirs_state.items():
        torch.testing.assert_close(ours_state[name], tensor, rtol=0, atol=0, msg=name)


def test_gguf_engine_matches_transformers(converted: tuple[str, Converted]) -> None:
    assert_engine_matches(converted[1])


@pytest.mark.skipif(not kernel_levels(), reason="no fused CPU kernels on this CPU")
def test_q8_0_gguf_runs_packed_as_dequantized(converted: tuple[str, Converted]) -> None:
    """The converter's own Q8_0 output: every matmul and the tied head packed, greedy tokens
    equal to the same file dequantised at load."""
    family, files = converted
    path = convert(family, files.folder, files.folder / "tiny-q8_0.gguf", "q8_0")

    def load(is_dequantized: bool) -> GemmaForCausalLM:
        config = ModelLoadingConfig(model_name_or_path=str(path), torch_dtype="float32")
        config.gguf_dequantize_at_load = is_dequantized
        return load_model(config)[0]  # type: ignore[return-value]

    packed, plain = load(False), load(True)
    layer = packed.layers[0]
    assert all(isinstance(getattr(layer, n), PackedLinear) for n in ("qkv", "o_proj", "down"))
    assert isinstance(packed.lm_head_linear, PackedLinear)
    assert greedy(packed) == greedy(plain)


def test_llama_cpp_attention_scale_and_layer_pattern() -> None:
    """What llama.cpp assumes where a file is silent: the 27B models scale by hidden / heads;
    a per-layer pattern array wins over the period; a Gemma 2 window defaults to 4096."""
    config = ModelArchConfig(
        vocab_size=8, hidden_size=4608, intermediate_size=8, num_hidden_layers=46,
        num_attention_heads=32, num_key_value_heads=16, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=8192,
        tie_word_embeddings=True, attention_bias=False,
    )  # fmt: skip
    gemma2 = with_gguf_gemma(config, "gemma2", lambda key, default: default)
    assert gemma2.attention_scale == 144.0**-0.5
    assert gemma2.sliding_window == 4096 and gemma2.layer_types[:2] == (
        "sliding_attention",
        "full_attention",
    )
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    pattern = [True, False] * 3
    meta = {"attention.sliding_window": 512, "attention.sliding_window_pattern": pattern}
    small = dataclasses.replace(config, num_hidden_layers=6)
    gemma3 = with_gguf_gemma(small, "gemma3", lambda key, default: meta.get(key, default))
    assert gemma3.attention_scale == 128.0**-0.5
    assert gemma3.layer_types == ("sliding_attention", "full_attention") * 3
    assert (gemma3.sliding_rope_theta, gemma3.final_logit_softcap) == (10000.0, None)
