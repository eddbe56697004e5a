"""Mixture-of-experts families (Mixtral, Qwen3-MoE) against transformers, token for token.

Tiny random checkpoints are built with transformers' own config and model classes (4 experts,
top-2; Qwen3-MoE with one dense layer through ``mlp_only_layers``, tied embeddings; Mixtral
untied) and saved sharded. Through the engine, batched together, after swap preemptions and
at every CPU ISA level this machine can run (forced), the greedy tokens must equal
transformers' float32 greedy tokens. The router must choose transformers' experts with its
weights, and the grouped expert path must equal the plain dense reference. Expert tensors
load from the Hub's per-expert layout, transformers 5's stacked one and a GPTQ checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from harness.gptq_writer import TOKENIZER_FILES, write_checkpoint
from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.engine_config import EngineConfig, ModelLoadingConfig
from server.continuous_batching.model import UnsupportedModelError, read_hf_config
from server.continuous_batching.model.architecture import ModelArchConfig
from server.continuous_batching.model.decoder_ops import TorchDecoderOps, decoder_ops_for
from server.continuous_batching.model.moe import SparseMoe, moe_reference, route
from server.continuous_batching.model.moe_layers import (
    MoeDecoderLayer,
    Qwen3MoeDecoderLayer,
    Qwen3MoeDenseDecoderLayer,
)
from server.continuous_batching.model.weights import (
    iter_safetensors,
    load_model,
    safetensors_files,
)
from server.continuous_batching.quantization.packed_linear import PackedLinear
from tests.engine.conftest import assert_no_leak, tokens_of
from tests.support.cpu_paths import kernel_levels, runnable_levels

VOCAB = 256
NUM_NEW = 10
CPU = torch.device("cpu")
#: Prompt lengths: one under a block, several spanning blocks.
PROMPT_LENGTHS = (5, 23, 40, 17, 31, 12)


def tiny_mixtral() -> MixtralForCausalLM:
    """A 2-layer Mixtral, 4 experts, top-2, untied embeddings."""
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return MixtralForCausalLM(config)


def tiny_qwen3_moe() -> Qwen3MoeForCausalLM:
    """A 3-layer Qwen3-MoE (layer 1 dense), 4 experts, top-2, q/k norms, tied embeddings."""
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return Qwen3MoeForCausalLM(config)


BUILDERS: dict[str, Callable[[], PreTrainedModel]] = {
    "mixtral": tiny_mixtral,
    "qwen3_moe": tiny_qwen3_moe,
}


@dataclass
class Checkpoint:
    """A saved tiny model, transformers' float32 model of it and its greedy tokens."""

    path: Path
    tokenizer_path: Path
    hf: PreTrainedModel
    prompts: list[list[int]]
    expected: list[list[int]]


def hf_greedy(hf: PreTrainedModel, ids: list[int], steps: int) -> list[int]:
    """transformers' float32 greedy tokens (full forwards: no EOS stops, no cache)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def perturb_norms(hf: PreTrainedModel, generator: torch.Generator) -> None:
    """Random RMSNorm weights (transformers initialises them to ones, which would hide a norm
    weight loaded into the wrong place)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def checkpoint(request, tmp_path_factory, default_model_path: Path) -> Checkpoint:
    torch.manual_seed(0)
    hf = BUILDERS[request.param]().eval()
    generator = torch.Generator().manual_seed(1)
    perturb_norms(hf, generator)
    path = tmp_path_factory.mktemp(request.param)
    # Small shards: the loader must follow model.safetensors.index.json.
    hf.save_pretrained(path, max_shard_size="100KB")
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    return Checkpoint(path, default_model_path, hf, prompts, expected)


def engine_for(
    ckpt: Checkpoint, level: str = "auto", dtype: str = "float32", **cache: object
) -> LLMEngine:
    """An engine over the checkpoint (the default model's tokenizer: prompts are ids)."""
    config = EngineConfig.model_validate(
        {
            "model_loading_config": {
                "model_name_or_path": str(ckpt.path),
                "tokenizer_name_or_path": str(ckpt.tokenizer_path),
                "torch_dtype": dtype,
                "cpu_isa": level,
            },
            "batcher_config": {"batch_max_tokens": 512, "batch_max_beams": 16},
            "cache_config": {"num_blocks": 64, "num_blocks_cpu": 64, "block_size": 16, **cache},
        }
    )
    return LLMEngine(config)


def generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of every prompt, all submitted together (ignoring EOS)."""
    configs = [GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True)] * len(prompts)
    return [tokens_of(deltas)[0] for deltas in engine.generate(prompts, configs)]


def test_sharded_checkpoint_reads_the_family(checkpoint) -> None:
    assert len(safetensors_files(checkpoint.path)) > 1
    arch = read_hf_config(json.loads((checkpoint.path / "config.json").read_text()))
    assert (arch.num_experts, arch.num_experts_per_tok) == (4, 2)
    model, _ = load_model(ModelLoadingConfig(model_name_or_path=str(checkpoint.path)))
    kinds = [type(layer) for layer in model.layers]
    if arch.family == "mixtral":
        assert kinds == [MoeDecoderLayer] * 2 and arch.moe_intermediate_size == 96
        assert not arch.tie_word_embeddings
    else:
        assert kinds == [Qwen3MoeDecoderLayer, Qwen3MoeDenseDecoderLayer, Qwen3MoeDecoderLayer]
        assert arch.moe_intermediate_size == 48 and arch.is_norm_topk_prob
        assert arch.tie_word_embeddings


@pytest.mark.parametrize("level", runnable_levels())
def test_batched_greedy_matches_transformers_at_every_level(checkpoint, level) -> None:
    engine = engine_for(checkpoint, level)
    assert engine.runner.compute_path.isa == level
    assert generate(engine, checkpoint.prompts) == checkpoint.expected
    # Again with the prompts' prefixes cached: the prefix cache changes nothing.
    hits_before = engine.block_manager.num_prefix_hit_tokens
    assert generate(engine, checkpoint.prompts[:3]) == checkpoint.expected[:3]
    assert engine.block_manager.num_prefix_hit_tokens > hits_before
    assert_no_leak(engine)


def test_greedy_after_swap_matches_transformers(checkpoint) -> None:
    engine = engine_for(
        checkpoint, num_blocks=8, num_blocks_cpu=64, watermark=0.0, enable_prefix_caching=False
    )
    assert generate(engine, checkpoint.prompts) == checkpoint.expected
    assert engine.stats.num_swap_preemptions > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("level", kernel_levels())
def test_bfloat16_stays_close(checkpoint, level) -> None:
    # bfloat16 (the kernels' packed matmul per expert) may flip a near tie late in a
    # sequence; the first tokens of every prompt must agree with float32.
    got = generate(engine_for(checkpoint, level, "bfloat16"), checkpoint.prompts)
    assert all(g[:2] == e[:2] for g, e in zip(got, checkpoint.expected, strict=True))


def moe_arch(num_experts: int = 4, top_k: int = 2, is_norm_topk_prob: bool = True):
    """A ModelArchConfig with just what ``SparseMoe`` reads."""
    return ModelArchConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=False,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=40,
        is_norm_topk_prob=is_norm_topk_prob,
    )


def by_expert(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (experts, weights) sorted by expert id: the order of the k is irrelevant."""
    experts, order = experts.sort(dim=-1)
    return experts, weights.gather(-1, order)


@pytest.mark.parametrize(
    "family,is_norm", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]
)
def test_routing_matches_transformers(family, is_norm) -> None:
    generator = torch.Generator().manual_seed(2)
    if family == "mixtral":
        config = MixtralConfig(hidden_size=64, num_local_experts=8, num_experts_per_tok=2)
        router = MixtralTopKRouter(config)
    else:
        config = Qwen3MoeConfig(
            hidden_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=is_norm
        )
        router = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
    hidden = torch.randn(50, 64, generator=generator)
    # Ties: a zero row gives every expert the same probability; duplicated rows tie alike.
    hidden[7] = 0
    hidden[8] = hidden[9]
    logits, hf_weights, hf_experts = router(hidden)
    ours = route(logits, router.top_k, is_norm)
    assert ours.weights.dtype == torch.float32
    expected_experts, expected_weights = by_expert(hf_weights, hf_experts)
    got_experts, got_weights = by_expert(ours.weights, ours.experts)
    torch.testing.assert_close(
        got_weights[7], torch.full((router.top_k,), 0.5 if is_norm else 1 / 8)
    )
    rows = [i for i in range(50) if i != 7]  # the tied row may pick any two experts
    assert torch.equal(got_experts[rows], expected_experts[rows])
    torch.testing.assert_close(got_weights, expected_weights.float(), rtol=0, atol=1e-7)
    if is_norm:
        torch.testing.assert_close(ours.weights.sum(-1), torch.ones(50))


def random_moe(
    dtype: torch.dtype, is_norm: bool = True
) -> tuple[SparseMoe, dict[str, torch.Tensor]]:
    """A SparseMoe with random weights, and a float32 copy of them."""
    moe = SparseMoe(moe_arch(is_norm_topk_prob=is_norm), dtype, CPU)
    generator = torch.Generator().manual_seed(3)
    plain = {}
    for name, p in moe.named_parameters():
        plain[name] = (torch.randn(p.shape, generator=generator) * 0.3).to(dtype).float()
        p.data.copy_(plain[name])
    return moe, plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("ops", ["torch", "fused"])
def test_grouped_experts_match_the_dense_reference(dtype, ops) -> None:
    fused_ops = decoder_ops_for(CPU, use_cpu_kernels=True)
    if ops == "fused" and fused_ops.module is None:
        pytest.skip("the fused CPU kernels could not be built")  # only at the generic level
    decoder_ops = fused_ops if ops == "fused" else TorchDecoderOps()
    moe, plain = random_moe(dtype, is_norm=dtype == torch.float32)
    if ops == "fused":
        # The packed matmuls: the kernels' bf16 one, oneDNN's float32 one.
        moe.finalize("kernels" if dtype == torch.bfloat16 else "onednn", fused_ops.module)
    h = torch.randn(37, 64, generator=torch.Generator().manual_seed(4))
    h[5] = h[6]  # a repeated token routes the same
    expected = moe_reference(
        h.to(dtype).float(),
        plain["gate_weight"],
        plain["gate_up_weight"],
        plain["down_weight"],
        moe.top_k,
        moe.is_norm_topk_prob,
    )
    got = moe(h.to(dtype), decoder_ops)
    assert got.dtype == torch.float32 and got.shape == (37, 64)
    atol = 1e-5 if dtype == torch.float32 else 0.03 * float(expected.abs().max())
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    # The sync-free dense path (the one CUDA graphs capture) gives the same.
    routing = route(moe.router(h.to(dtype)), moe.top_k, moe.is_norm_topk_prob)
    torch.testing.assert_close(
        moe._dense(h.to(dtype), routing, decoder_ops), got, atol=atol, rtol=0
    )


def test_stacked_expert_layout_loads_the_same(checkpoint, tmp_path) -> None:
    # transformers 5's in-memory layout (mlp.experts.gate_up_proj [E, 2I, H], down_proj
    # [E, H, I]; Mixtral's block under mlp.) saved as is must load into the same model.
    state = {k: v.contiguous() for k, v in checkpoint.hf.state_dict().items()}
    if checkpoint.hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((checkpoint.path / "config.json").read_text())
    stacked, _ = load_model(ModelLoadingConfig(model_name_or_path=str(tmp_path)))
    per_expert, _ = load_model(ModelLoadingConfig(model_name_or_path=str(checkpoint.path)))
    expected = dict(per_expert.named_parameters())
    for name, p in stacked.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_mixtral_sliding_window_shorter_than_the_context_is_refused() -> None:
    d = {**tiny_mixtral().config.to_dict(), "architectures": ["MixtralForCausalLM"]}
    assert read_hf_config(d).family == "mixtral"
    assert read_hf_config({**d, "sliding_window": 4096}).num_experts == 4  # >= 256 positions
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        read_hf_config({**d, "sliding_window": 64})


def test_gptq_checkpoint_matches_dequantised_transformers(checkpoint, tmp_path) -> None:
    # AutoGPTQ's layout (harness.gptq_writer) from the Hub-named tensors: attention runs as
    # int4 (packed at float32); quantised experts (Qwen3-MoE's *_proj; Mixtral's w1/w2/w3 stay
    # float16 as the writer knows only the llama names) are dequantised at load.
    staging, folder, reference_dir = (tmp_path / n for n in ("staging", "gptq", "reference"))
    for d in (staging, folder, reference_dir):
        d.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(checkpoint.path / name, staging / name)
    for name in TOKENIZER_FILES:
        shutil.copy(checkpoint.tokenizer_path / name, staging / name)
    source = dict(iter_safetensors(checkpoint.path))
    reference = write_checkpoint(folder, staging, source, fmt="gptq", group_size=32, desc_act=False)
    save_file(reference, str(reference_dir / "model.safetensors"))
    shutil.copy(checkpoint.path / "config.json", reference_dir / "config.json")
    hf = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, NUM_NEW) for p in checkpoint.prompts[:3]]
    config = EngineConfig.model_validate(
        {
            "model_loading_config": {
                "model_name_or_path": str(folder),
                "torch_dtype": "float32",
                "quantize_method": "gptq",
            },
            "cache_config": {"num_blocks": 64, "num_blocks_cpu": 0, "block_size": 16},
        }
    )
    engine = LLMEngine(config)
    # gptq_cpu_kernel auto: float32 has no torch int4 kernel, so the packed kernels run.
    assert isinstance(engine.runner.model.layers[0].qkv, PackedLinear)
    assert generate(engine, checkpoint.prompts[:3]) == expected


def test_qwen3_moe_hub_config_names_and_sparse_step() -> None:
    # Hub configs name the count num_experts; decoder_sparse_step 2 makes every second layer
    # MoE (transformers' rule), mlp_only_layers overrides it.
    d = {**tiny_qwen3_moe().config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    d.pop("num_local_experts")
    d.update(num_experts=6, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    arch = read_hf_config(d)
    assert arch.num_experts == 6
    assert [arch.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
