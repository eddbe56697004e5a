"""Gemma 2 and Gemma 3 (text) in the engine against transformers, on tiny random checkpoints.

The checkpoints are built here: a few layers, sliding and full attention layers, every norm
weight random (so a missing ``1 +`` shows), an attention scale that is not head_dim's, small
soft caps for Gemma 2 (so a missing cap shows), and for Gemma 3 q/k norms and two RoPE bases
with linear scaling on the global layers. transformers runs float32 with eager attention (its
Gemma 2 soft-capping). The sliding window (12 tokens) is shorter than most prompts plus
outputs, so the sliding layers' window is checked too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.engine_config import EngineConfig
from server.continuous_batching.model import UnsupportedModelError, paged_attention, read_hf_config
from server.continuous_batching.model.gemma import GemmaForCausalLM
from server.continuous_batching.model.weights import load_model
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.engine.test_cb_model import PagedRunner, assert_logits_close, greedy, loading, use_ops
from tests.support.cpu_paths import runnable_levels

NUM_NEW = 10
VOCAB = 256
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    # Shorter than most prompts plus outputs, and no whole number of blocks.
    "sliding_window": 12,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
CONFIGS = {
    # head_dim 64: the kernels' vector passes; caps small enough to change the scores.
    "gemma2": Gemma2Config(
        **COMMON,
        head_dim=64,
        query_pre_attn_scalar=48,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # head_dim 16: the kernels' portable loops; layers sliding, full, sliding, full.
    "gemma3": Gemma3TextConfig(
        **COMMON,
        head_dim=16,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
    ),
}
HF_CLASSES = {"gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM}


def random_prompts(num: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 23, 12, 17, 9, 30][:num]
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = random_prompts(3, seed=0)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """(folder, transformers model) of a tiny random Gemma with random norm weights."""
    torch.manual_seed(7)
    config = CONFIGS[family]
    config._attn_implementation = "eager"
    hf = HF_CLASSES[family](config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # Small embeddings (Gemma multiplies them by 8 here): varied greedy tokens.
            p.normal_(0.0, 0.4 if "norm" in name else 0.02 if "embed" in name else 0.15)
    folder = tmp_path_factory.mktemp(family)
    hf.save_pretrained(folder)
    return folder, hf


def hf_greedy(hf, prompt: list[int], steps: int = NUM_NEW) -> list[int]:
    """transformers' greedy tokens, a full forward per token (no cache, no EOS handling)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[int]]:
    return [hf_greedy(checkpoint[1], p) for p in PROMPTS]


@pytest.fixture(scope="module")
def ours(checkpoint) -> GemmaForCausalLM:
    config = loading(checkpoint[0])
    config.model_type = "gemma"
    model = load_model(config)[0]
    assert isinstance(model, GemmaForCausalLM)
    return model


def test_config_reader(family, checkpoint) -> None:
    arch = read_hf_config(json.loads((checkpoint[0] / "config.json").read_text()))
    assert arch.family == {"gemma2": "gemma2", "gemma3": "gemma3_text"}[family]
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.tie_word_embeddings
    assert [arch.window_of(i) for i in range(4)] == [12, None, 12, None]
    if family == "gemma2":
        assert arch.attention_scale == 48**-0.5
        assert (arch.attn_logit_softcap, arch.final_logit_softcap) == (3.0, 4.0)
        assert arch.sliding_rope_theta is None
    else:
        assert arch.attention_scale == 24**-0.5
        assert arch.attn_logit_softcap is None and arch.final_logit_softcap is None
        assert (arch.rope_theta, arch.rope_scaling) == (
            1000.0,
            {"rope_type": "linear", "factor": 4.0},
        )
        assert (arch.sliding_rope_theta, arch.sliding_rope_scaling) == (50.0, None)


def test_gemma3_legacy_rope_keys_and_default_pattern() -> None:
    # Configs written before transformers 5: rope_theta/rope_scaling for the global layers,
    # rope_local_base_freq for the local ones, sliding_window_pattern instead of layer_types.
    d = {
        **COMMON,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 7,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,
    }
    arch = read_hf_config(d)
    assert (arch.rope_theta, arch.rope_scaling) == (
        1_000_000.0,
        {"rope_type": "linear", "factor": 8.0},
    )
    assert arch.sliding_rope_theta == 10000.0
    assert arch.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert arch.attention_scale == 256**-0.5


def test_multimodal_gemma3_is_refused_clearly() -> None:
    d = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}
    with pytest.raises(UnsupportedModelError, match="Gemma3ForCausalLM"):
        read_hf_config(d)


def test_batched_prefill_logits_match_transformers(ours, checkpoint) -> None:
    logits = PagedRunner(use_ops(ours, "torch")).step([(f"p{i}", p) for i, p in enumerate(PROMPTS)])
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            assert_logits_close(logits[i], checkpoint[1](torch.tensor([prompt])).logits[0, -1])


@pytest.mark.parametrize(
    "ops,max_kv_heads",
    [("torch", 4), ("torch", 0), ("fused", 0)],
    ids=["torch_bd", "torch_per_head", "fused_kernels"],
)
def test_greedy_matches_transformers(ours, expected, ops, max_kv_heads, monkeypatch) -> None:
    # Both torch decode layouts and the fused CPU kernels (attention included: the soft cap
    # and the scale go through the kernel) must give transformers' tokens.
    monkeypatch.setattr(paged_attention, "BLOCK_DIAGONAL_MAX_KV_HEADS", max_kv_heads)
    assert greedy(PagedRunner(use_ops(ours, ops)), PROMPTS, steps=NUM_NEW) == expected


@pytest.mark.parametrize("ops", ["torch", "fused"])
def test_bfloat16_stays_close_to_float32_transformers(family, checkpoint, ops) -> None:
    # bfloat16 rounds 1 + w of the folded norms once (transformers keeps it in float32) and
    # everything else as the llama path does; on these random models, measured: 4-5 of the 6
    # continuations identical to float32 transformers', the first 3 tokens of 5-6.
    prompts = random_prompts(6, seed=1)
    expected = [hf_greedy(checkpoint[1], p) for p in prompts]
    config = loading(checkpoint[0], "bfloat16")
    config.model_type = "gemma"
    model = use_ops(load_model(config)[0], ops)
    got = greedy(PagedRunner(model), prompts, steps=NUM_NEW)
    assert sum(a == b for a, b in zip(got, expected, strict=True)) >= 4
    assert sum(a[:3] == b[:3] for a, b in zip(got, expected, strict=True)) >= 5


def test_chunked_prefill_matches_whole(ours) -> None:
    ids = PROMPTS[1] + PROMPTS[2]
    whole = PagedRunner(use_ops(ours, "torch")).step([("a", ids)])[0]
    runner = PagedRunner(ours)
    runner.step([("a", ids[:11])])
    assert_logits_close(runner.step([("a", ids[11:])])[0], whole, rel=1e-5)


def engine_config(path: Path, level: str, default_model_path: Path) -> EngineConfig:
    """A small-cache engine over the Gemma folder (the default model's tokenizer: only ids
    matter here), forced to ``level``: few device blocks, so requests get swapped out."""
    return EngineConfig.model_validate(
        {
            "model_loading_config": {
                "model_type": "gemma",
                "model_name_or_path": str(path),
                "tokenizer_name_or_path": str(default_model_path),
                "torch_dtype": "float32",
                "cpu_isa": level,
            },
            "batcher_config": {"batch_max_tokens": 512, "batch_max_beams": 64},
            "cache_config": {
                "num_blocks": 8,
                "num_blocks_cpu": 64,
                "block_size": 16,
                "watermark": 0.0,
                "enable_prefix_caching": False,
            },
        }
    )


@pytest.mark.parametrize("level", runnable_levels())
def test_engine_at_every_level_with_swaps(family, checkpoint, level, default_model_path) -> None:
    # Six requests in one engine at a forced ISA level, more than its 8 device blocks hold:
    # some are swapped out and back, and each must still give transformers' tokens.
    prompts = random_prompts(6, seed=1)
    config = engine_config(checkpoint[0], level, default_model_path)
    engine = LLMEngine(config, runner=ModelRunner(config))
    assert engine.runner.compute_path.isa == level
    results = engine.generate(
        prompts, [GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True)] * len(prompts)
    )
    assert engine.stats.num_swap_preemptions > 0
    for deltas, prompt in zip(results, prompts, strict=True):
        assert [t for d in deltas for t in d.token_ids] == hf_greedy(checkpoint[1], prompt)
