"""GGUF models served with their matmul weights kept quantised (packed) on a CPU give the same
greedy tokens as the same file loaded the plain way (every tensor dequantised to float32 at
load): tiny random llamas written in each packable type, and a Q4_K_M-like mix (Q6_K v and
down, an F16 gate next to a Q4_K up, an untied Q6_K lm_head). With int8 activations (the
``gguf_activations: int8``, as llama.cpp), the logits stay close to the plain path's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors import safe_open
from transformers import AutoTokenizer

from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.engine_config import ModelLoadingConfig
from server.continuous_batching.model import (
    LlamaForCausalLM,
    build_attention_metadata,
    kv_cache_shape,
)
from server.continuous_batching.model.llama import LlamaDecoderLayer
from server.continuous_batching.model.weights import load_model, read_arch_config
from server.continuous_batching.quantization.packed_linear import ConcatLinear, PackedLinear
from tests.support.cpu_paths import kernel_levels
from tests.support.default_model import engine_config
from tests.support.gguf_files import write_tiny_llama
from tools.prepare_model import find_gguf

CPU = torch.device("cpu")
BLOCK = 16
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2]]
NUM_NEW = 6

pytestmark = pytest.mark.skipif(not kernel_levels(), reason="no fused CPU kernels on this CPU")


def _load(
    path: Path,
    is_dequantized: bool,
    dtype: str = "float32",
    isa: str = "auto",
    activations: str = "float",
):
    """The model of ``path`` (float activations, the default, unless said)."""
    config = ModelLoadingConfig(
        model_name_or_path=str(path),
        torch_dtype=dtype,
        cpu_isa=isa,
        gguf_dequantize_at_load=is_dequantized,
        gguf_activations=activations,
    )
    model, _ = load_model(config)
    return model


def _prefill_logits(model: LlamaForCausalLM, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt prefilled in one forward; the last token's logits of each."""
    lens, tables, nxt = [len(p) for p in prompts], [], 1
    for n in lens:
        tables.append(list(range(nxt, nxt + -(-n // BLOCK))))
        nxt += len(tables[-1])
    meta = build_attention_metadata(lens, lens, tables, BLOCK, CPU)
    shape = kv_cache_shape(model.config, nxt, BLOCK)
    zeros = [torch.zeros(shape, dtype=model.dtype) for _ in range(2 * len(model.layers))]
    caches = list(zip(zeros[::2], zeros[1::2], strict=True))
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for n in lens for i in range(n)])
    hidden = model(ids, positions, caches, meta)
    return model.compute_logits(hidden[torch.tensor(lens).cumsum(0) - 1])


def greedy(model: LlamaForCausalLM) -> list[list[int]]:
    """NUM_NEW greedy tokens per prompt (each step a fresh prefill of the whole sequence)."""
    seqs = [list(p) for p in PROMPTS]
    for _ in range(NUM_NEW):
        for seq, token in zip(seqs, _prefill_logits(model, seqs).argmax(-1).tolist(), strict=True):
            seq.append(token)
    return [seq[len(p) :] for seq, p in zip(seqs, PROMPTS, strict=True)]


def _linears(layer: LlamaDecoderLayer) -> dict[str, object]:
    return {name: getattr(layer, name) for name in ("qkv", "o_proj", "gate_up", "down")}


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K], ids=str)
def test_packed_tokens_equal_dequantized(tmp_path, qtype) -> None:
    path = write_tiny_llama(tmp_path / f"{qtype.name}.gguf", {}, qtype, seed=int(qtype))
    packed, plain = _load(path, False), _load(path, True)
    assert all(isinstance(m, PackedLinear) for m in _linears(packed.layers[0]).values())
    assert isinstance(packed.lm_head_linear, PackedLinear)  # tied: token_embd's own type
    # The table stays packed too: the tied head's weight is the embedding.
    assert packed.packed_embedding is packed.lm_head_linear.weight
    assert packed.embed_tokens is None and plain.packed_embedding is None
    bits = 4 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 8
    level = packed.cpu_path.level
    assert packed.weight_format == f"gguf {qtype.name} (packed int{bits}, {level})"
    assert plain.weight_format == "gguf dequantised to float32 at load"
    expected = greedy(plain)
    assert len({t for row in expected for t in row}) > 1  # not one token repeated
    assert greedy(packed) == expected
    logits = _prefill_logits(packed, PROMPTS)
    torch.testing.assert_close(logits, _prefill_logits(plain, PROMPTS), atol=2e-4, rtol=2e-4)


def test_mixed_types_and_untied_head(tmp_path) -> None:
    types = {"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "ffn_gate": T.F16, "output": T.Q6_K}
    path = write_tiny_llama(tmp_path / "mix.gguf", types, T.Q4_K, is_tied=False)
    packed, plain = _load(path, False), _load(path, True)
    linears = _linears(packed.layers[0])
    assert isinstance(linears["qkv"], ConcatLinear)  # Q4_K q/k, Q6_K v: separate parts
    # q and k share a layout: one stacked matmul, then v's.
    assert [p.weight.source for p in linears["qkv"].parts] == ["Q4_K", "Q6_K"]
    assert isinstance(linears["down"], PackedLinear) and packed.lm_head is None
    # Untied: the Q4_K table is packed on its own, beside the Q6_K head.
    assert packed.packed_embedding.source == "Q4_K" and packed.embed_tokens is None
    assert not isinstance(linears["gate_up"], PackedLinear | ConcatLinear)  # F16 gate: dense
    level = packed.cpu_path.level
    assert packed.compute_path().weights == f"gguf Q4_K, Q6_K (packed int4/int8, {level})"
    assert "weights: gguf Q4_K, Q6_K" in packed.compute_path().summary
    assert greedy(packed) == greedy(plain)


def test_bf16_model_and_generic_level(tmp_path) -> None:
    path = write_tiny_llama(tmp_path / "q4k.gguf", {}, T.Q4_K)
    packed = _load(path, False, dtype="bfloat16")
    plain = _load(path, True)  # float32: the bf16 model's weights are exact, its math bf16
    torch.testing.assert_close(
        _prefill_logits(packed, PROMPTS), _prefill_logits(plain, PROMPTS), atol=0.05, rtol=0.05
    )
    # The generic level has no kernels: the plain path, said so on /health.
    generic = _load(path, False, isa="generic")
    assert generic.compute_path().weights == "gguf dequantised to float32 at load"


def test_int8_activations_stay_close(tmp_path) -> None:
    path = write_tiny_llama(tmp_path / "q4k.gguf", {"output": T.Q6_K}, T.Q4_K, is_tied=False)
    config = ModelLoadingConfig(model_name_or_path=str(path))
    # auto (the default): int8 from 1B weights up, float below (this model: float).
    assert config.gguf_activations == "auto"
    assert config.is_int8_activations(10**9) and not config.is_int8_activations(10**9 - 1)
    forced = config.model_copy(update={"gguf_activations": "float"})
    assert not forced.is_int8_activations(10**10)
    int8 = _load(path, False, activations="int8")
    exact = _load(path, False, activations="auto")
    assert "int8 activations" not in exact.weight_format
    linears = [*_linears(int8.layers[0]).values(), int8.lm_head_linear]
    if not getattr(int8.decoder_ops.module, "has_int8_activations", False):
        # A kernels build without AVX2: float activations, said so on /health.
        assert not any(getattr(m, "is_int8", False) for m in linears)
        assert "int8 activations" not in int8.weight_format
        return
    assert all(m.is_int8 for m in linears if isinstance(m, PackedLinear))
    # AVX512-VNNI and AVX2 builds tile the K-quant rows (qgemm_lanes*.h), and /health says so.
    is_tiled = getattr(int8.decoder_ops.module, "has_lane_tiles", False)
    assert any(m.weight.is_lane_tiled for m in linears if isinstance(m, PackedLinear)) == is_tiled
    tail = ", int8 activations, 16-row tiles)" if is_tiled else ", int8 activations)"
    assert int8.weight_format.endswith(tail)
    logits, expected = _prefill_logits(int8, PROMPTS), _prefill_logits(exact, PROMPTS)
    assert not torch.equal(logits, expected)  # the inputs really were quantised
    scale = expected.abs().max().item()
    assert (logits - expected).abs().max().item() < 0.05 * scale


def test_num_parameters_counts_the_checkpoint(default_model_path: Path) -> None:
    """``num_parameters`` (what ``gguf_activations: auto`` decides by) against the default
    model's own tensors: every matmul and the (tied) table, norms left out."""
    arch = read_arch_config(default_model_path)
    with safe_open(str(default_model_path / "model.safetensors"), "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
    matrices = sum(math.prod(shape) for shape in shapes.values() if len(shape) == 2)
    assert arch.num_parameters == matrices


def test_the_default_gguf_alone_chats_and_names_paris(default_model_path: Path) -> None:
    """The shipped Q4_1 file served on its own (no tokenizer folder): its embedded tokenizer
    and chat template (which transformers' conversion leaves out) are used, the matmuls stay
    packed (float inputs: a 135M model), and the demo's question is answered."""
    gguf = find_gguf()
    config = engine_config(gguf, num_blocks=64, num_blocks_cpu=0)
    engine = LLMEngine(config)
    assert engine.runner.model.weight_format.startswith("gguf Q4_1, Q8_0 (packed int4/int8, ")
    assert "int8 activations" not in engine.runner.model.weight_format
    folder_tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = folder_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ours = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours == prompt
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    assert ids == folder_tokenizer.encode(prompt, add_special_tokens=False)
    result = engine.generate([ids], [GenerationConfig(max_new_tokens=12)])
    assert "Paris" in "".join(d.text for d in result[0])
