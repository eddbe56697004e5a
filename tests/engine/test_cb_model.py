"""The continuous-batching llama model against Hugging Face transformers.

Sequences run through a tiny test-side paged cache: each sequence owns a fixed list of
deliberately shuffled block ids, so a wrong block-table lookup shows up as wrong logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel
from transformers import LlamaForCausalLM as HFLlama

from server.continuous_batching.engine_config import ModelLoadingConfig
from server.continuous_batching.model import (
    LlamaForCausalLM,
    UnsupportedModelError,
    build_attention_metadata,
    kv_bytes_per_block,
    kv_cache_shape,
    paged_attention,
    read_hf_config,
)
from server.continuous_batching.model.decoder_ops import TorchDecoderOps, decoder_ops_for
from server.continuous_batching.model.paged_attention import BLOCK_DIAGONAL_MAX_KV_HEADS
from server.continuous_batching.model.weights import WeightLoadError, load_model

BLOCK_SIZE = 16
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far far away, there lived a little dragon who",
    "def fibonacci(n):",
]
CPU = torch.device("cpu")


def loading(path: Path, torch_dtype: str = "float32") -> ModelLoadingConfig:
    """The model_loading_config of a checkpoint on the CPU."""
    return ModelLoadingConfig(model_name_or_path=str(path), torch_dtype=torch_dtype)


@dataclass
class PagedRunner:
    """Minimal engine step loop: fixed shuffled block tables, one forward per step."""

    model: LlamaForCausalLM
    num_blocks: int = 64
    tables: dict[str, list[int]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c, dtype = self.model.config, self.model.dtype
        shape = kv_cache_shape(c, self.num_blocks, BLOCK_SIZE)
        self.caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(c.num_hidden_layers)
        ]
        # Reverse-interleaved block order: never contiguous, never ascending.
        self.free = [b for b in range(self.num_blocks - 1, 0, -1) if b % 2] + [
            b for b in range(self.num_blocks - 2, 0, -1) if not b % 2
        ]

    def step(self, feeds: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Feed new tokens per sequence in one forward; return last-token logits per feed."""
        query_lens, context_lens, tables, ids, positions = [], [], [], [], []
        for seq, new in feeds:
            past = self.tokens.setdefault(seq, [])
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < len(past) + len(new):
                table.append(self.free.pop(0))
            positions += range(len(past), len(past) + len(new))
            past += new
            ids += new
            query_lens.append(len(new))
            context_lens.append(len(past))
            tables.append(table)
        # Decode-only steps get the kernel's tables when the model has a kernel backend.
        kernel = self.model.attention_backend != "torch"
        meta = build_attention_metadata(
            query_lens, context_lens, tables, BLOCK_SIZE, CPU, with_decode_tables=kernel
        )
        hidden = self.model(
            torch.tensor(ids), torch.tensor(positions), self.caches, meta, block_size=BLOCK_SIZE
        )
        last = torch.tensor(query_lens).cumsum(0) - 1
        return self.model.compute_logits(hidden[last])


def hf_last_logits(hf: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    """Absolute tolerance scaled by the logit magnitude."""
    atol = rel * float(expected.abs().max())
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path):
    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def ours(default_model_path: Path) -> LlamaForCausalLM:
    return load_model(loading(default_model_path))[0]


def use_ops(model: LlamaForCausalLM, name: str) -> LlamaForCausalLM:
    """Switch ``model`` to the fused CPU kernels ("fused", skipped where they cannot be built)
    or to the plain torch reference ops ("torch")."""
    if name == "torch":
        model.set_decoder_ops(TorchDecoderOps())
        return model
    ops = decoder_ops_for(CPU, use_cpu_kernels=True)
    if ops.attention_backend != "cpu":
        pytest.skip("the fused CPU kernels could not be built")
    model.set_decoder_ops(ops)
    return model


def greedy(runner: PagedRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill all prompts in one forward, then decode all of them together."""
    names = [f"s{i}" for i in range(len(prompts))]
    logits = runner.step(list(zip(names, prompts, strict=True)))
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        for i, t in enumerate(nxt):
            out[i].append(t)
        logits = runner.step([(n, [t]) for n, t in zip(names, nxt, strict=True)])
    return out


def hf_greedy(hf: PreTrainedModel, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
    return gen[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def hf_tokens(hf_model, prompt_ids) -> list[list[int]]:
    """transformers' greedy continuations (8 tokens) of PROMPTS, one prompt at a time."""
    return [hf_greedy(hf_model, ids, 8) for ids in prompt_ids]


def test_batched_prefill_logits_match_hf(ours, hf_model, prompt_ids) -> None:
    runner = PagedRunner(ours)
    logits = runner.step([(f"p{i}", ids) for i, ids in enumerate(prompt_ids)])
    for i, ids in enumerate(prompt_ids):
        assert_logits_close(logits[i], hf_last_logits(hf_model, ids))


@pytest.mark.parametrize(
    "ops,max_kv_heads",
    [("torch", BLOCK_DIAGONAL_MAX_KV_HEADS), ("torch", 0), ("fused", 0)],
    ids=["torch_bd", "torch_per_head", "fused_kernels"],
)
def test_greedy_matches_hf(ours, prompt_ids, hf_tokens, ops, max_kv_heads, monkeypatch) -> None:
    # Both torch decode attention layouts (block-diagonal and per-head) and the fused CPU
    # kernels must give HF's tokens.
    monkeypatch.setattr(paged_attention, "BLOCK_DIAGONAL_MAX_KV_HEADS", max_kv_heads)
    assert greedy(PagedRunner(use_ops(ours, ops)), prompt_ids, steps=8) == hf_tokens


def test_chunked_prefill_matches_single_forward(ours, hf_model, prompt_ids) -> None:
    ids = prompt_ids[1] + prompt_ids[2] + prompt_ids[0]
    whole = PagedRunner(ours).step([("a", ids)])[0]
    runner = PagedRunner(ours)
    cut1, cut2 = len(ids) // 3, 2 * len(ids) // 3 + 1
    for chunk in (ids[:cut1], ids[cut1:cut2]):
        runner.step([("a", chunk)])
    chunked = runner.step([("a", ids[cut2:])])[0]
    assert_logits_close(chunked, whole, rel=1e-5)
    assert_logits_close(chunked, hf_last_logits(hf_model, ids))


@pytest.mark.parametrize("ops", ["torch", "fused"])
def test_mixed_step_decode_and_prefill(ours, hf_model, prompt_ids, ops) -> None:
    runner = PagedRunner(use_ops(ours, ops))
    first = runner.step([("a", prompt_ids[0])])[0].argmax().item()
    runner.step([("c", prompt_ids[2][:3])])
    # One forward: a prefill, a decode and a second prefill chunk (prompt in the middle).
    logits = runner.step([("b", prompt_ids[1]), ("a", [first]), ("c", prompt_ids[2][3:])])
    assert_logits_close(logits[0], hf_last_logits(hf_model, prompt_ids[1]))
    assert_logits_close(logits[1], hf_last_logits(hf_model, prompt_ids[0] + [first]))
    assert_logits_close(logits[2], hf_last_logits(hf_model, prompt_ids[2]))


def test_bfloat16_greedy_matches_hf(default_model_path, prompt_ids) -> None:
    ours_bf16 = load_model(loading(default_model_path, "bfloat16"))[0]
    hf_bf16 = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.bfloat16)
    expected = hf_greedy(hf_bf16.eval(), prompt_ids[0], 8)
    for ops in ("fused", "torch"):
        tokens = greedy(PagedRunner(use_ops(ours_bf16, ops)), prompt_ids[:1], steps=8)[0]
        assert tokens == expected, ops


def tiny_llama(tmp_path: Path) -> tuple[Path, PreTrainedModel]:
    """Random llama with untied embeddings, llama3 RoPE and biases, saved in 2+ shards."""
    sizes = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96}
    sizes.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    rope.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    config = LlamaConfig(
        **sizes,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=True,
        rope_parameters=rope,
    )
    torch.manual_seed(0)
    model = HFLlama(config).eval()
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    return tmp_path, model


def test_tiny_sharded_llama3_rope_matches_hf(tmp_path: Path) -> None:
    path, hf = tiny_llama(tmp_path)
    assert (path / "model.safetensors.index.json").is_file()
    ours_tiny, config = load_model(loading(path))
    assert config.rope_scaling and config.rope_scaling["rope_type"] == "llama3"
    assert not config.tie_word_embeddings and config.attention_bias
    long_ids = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    short_ids = long_ids[:5]
    # One forward, two prefill groups (padding 150 vs 5 would waste too much), full logits.
    meta = build_attention_metadata([150, 5], [150, 5], [list(range(10)), [12]], BLOCK_SIZE, CPU)
    assert len(meta.groups) == 2
    shape = kv_cache_shape(config, 16, BLOCK_SIZE)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(2)]
    positions = torch.tensor(list(range(150)) + list(range(5)))
    hidden = ours_tiny(torch.tensor(long_ids + short_ids), positions, caches, meta)
    logits = ours_tiny.compute_logits(hidden)
    with torch.no_grad():
        ref_long = hf(torch.tensor([long_ids])).logits[0]
        ref_short = hf(torch.tensor([short_ids])).logits[0]
    assert_logits_close(logits[:150], ref_long)
    assert_logits_close(logits[150:], ref_short)
    assert kv_bytes_per_block(config, BLOCK_SIZE, torch.bfloat16) == 2 * 2 * 2 * 16 * 16 * 2


def test_loader_errors(tmp_path: Path) -> None:
    path, _ = tiny_llama(tmp_path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(loading(path))
    config_file.write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(WeightLoadError, match=r"missing .*model\.layers\.2\."):
        load_model(loading(path))


def test_config_reads_legacy_rope_scaling() -> None:
    legacy = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    config = read_hf_config(legacy)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.head_dim == 4 and config.num_key_value_heads == 2


def test_metadata_groups_and_output_order() -> None:
    # Flat order: prefill(3), decode, decode; decodes form one group, the prefill another.
    meta = build_attention_metadata([3, 1, 1], [5, 7, 20], [[4], [2], [9, 3]], 16, CPU)
    assert [tuple(g.token_index.shape) for g in meta.groups] == [(2, 1), (1, 3)]
    decode, prefill = meta.groups
    assert decode.token_range == (3, 5)
    assert decode.kv_slots[1, 17].item() == 3 * 16 + 1  # position 17 lives in block 3
    assert meta.output_index.tolist() == [2, 3, 4, 0, 1]
    assert meta.slot_mapping.tolist() == [
        4 * 16 + 2,
        4 * 16 + 3,
        4 * 16 + 4,
        2 * 16 + 6,
        3 * 16 + 3,
    ]
    # Prefill query j (position 2 + j) sees keys 0..2+j.
    assert prefill.mask[0, 0].sum(-1).tolist() == [3, 4, 5]
