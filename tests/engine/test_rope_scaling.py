"""RoPE scaling types (yarn, longrope, dynamic, linear, llama3) and the partial rotary factor
against transformers' ``ROPE_INIT_FUNCTIONS`` and rotary modules, for the same configs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Phi3Config, PretrainedConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from server.continuous_batching.model import UnsupportedModelError, read_hf_config
from server.continuous_batching.model.rotary import RotaryTables, rope_frequencies

SHAPES: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 128,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
LONG_FACTORS = {
    "short_factor": [1.0 + 0.05 * i for i in range(24)],
    "long_factor": [1.5 + 0.25 * i for i in range(24)],
}


def ours(hf_config: PretrainedConfig):
    d = hf_config.to_dict()
    d["architectures"] = [type(hf_config).__name__.replace("Config", "ForCausalLM")]
    return read_hf_config(d)


def hf_init(config: PretrainedConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), seq_len=seq_len)


CONFIGS = {
    "yarn": Qwen3Config(
        **SHAPES,
        max_position_embeddings=4096,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    ),
    "yarn_mscale": Qwen3Config(
        **SHAPES,
        max_position_embeddings=4096,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
        },
    ),
    "linear": LlamaConfig(**SHAPES, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama3": LlamaConfig(
        **SHAPES,
        max_position_embeddings=4096,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 1024,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_inv_freq_and_attention_factor_match_transformers(name: str) -> None:
    config = CONFIGS[name]
    inv_freq, attention_factor = hf_init(config)
    freqs = rope_frequencies(ours(config))
    torch.testing.assert_close(freqs.inv_freq, inv_freq, rtol=0, atol=0)
    assert freqs.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    assert freqs.long_inv_freq is None


def test_dynamic_ntk_is_fixed_at_the_scaled_length_as_vllm_does() -> None:
    config = LlamaConfig(
        **SHAPES, max_position_embeddings=512, rope_scaling={"type": "dynamic", "factor": 4.0}
    )
    # vLLM's base: transformers' dynamic formula at max_position_embeddings * factor.
    inv_freq, _ = hf_init(config, seq_len=512 * 4)
    freqs = rope_frequencies(ours(config))
    torch.testing.assert_close(freqs.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(freqs.inv_freq, hf_init(config)[0])  # really scaled


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_short_and_long_match_transformers(partial: float) -> None:
    factors = LONG_FACTORS if partial == 0.75 else {k: v * 2 for k, v in LONG_FACTORS.items()}
    config = Phi3Config(
        **SHAPES,
        max_position_embeddings=1024,
        original_max_position_embeddings=64,
        partial_rotary_factor=partial,
        rope_scaling={
            "type": "longrope",
            **{k: v[: int(32 * partial)] for k, v in factors.items()},
        },
    )
    arch = ours(config)
    assert arch.rotary_dim == int(64 * partial)
    freqs = rope_frequencies(arch)
    short, attention_factor = hf_init(config)
    long, _ = hf_init(config, seq_len=65)
    torch.testing.assert_close(freqs.inv_freq, short, rtol=0, atol=0)
    torch.testing.assert_close(freqs.long_inv_freq, long, rtol=0, atol=0)
    assert freqs.long_from == 64
    assert freqs.attention_factor == pytest.approx(attention_factor, rel=1e-12) != 1.0

    # cos/sin rows: short below position 64, long from there on, each as transformers'
    # rotary module gives them for a sequence of that kind.
    tables = RotaryTables(arch, torch.float32, torch.device("cpu"))
    module = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    short_pos, long_pos = torch.arange(64)[None], torch.arange(64, 100)[None]
    for positions in (short_pos, long_pos):
        cos, sin = module(x, positions)
        ours_cos, ours_sin = tables.lookup(positions[0])
        half = arch.rotary_dim // 2
        torch.testing.assert_close(ours_cos, cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours_sin[:, half:], sin[0, :, half:], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours_sin[:, :half], -sin[0, :, :half], rtol=0, atol=1e-6)


def test_yarn_cos_sin_carry_the_attention_factor() -> None:
    config = CONFIGS["yarn"]
    arch = ours(config)
    half = arch.rotary_dim // 2
    tables = RotaryTables(arch, torch.float32, torch.device("cpu"))
    positions = torch.arange(0, 4096, 37)
    cos, sin = Qwen3RotaryEmbedding(config)(torch.zeros(1), positions[None])
    ours_cos, ours_sin = tables.lookup(positions)
    torch.testing.assert_close(ours_cos, cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_sin[:, half:], sin[0, :, half:], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_sin[:, :half], -sin[0, :, :half], rtol=0, atol=1e-6)


def test_old_phi3_su_config_reads_as_longrope() -> None:
    # Phi-3's first configs: "su", original_max_position_embeddings beside rope_scaling.
    d = {
        **SHAPES,
        "architectures": ["Phi3ForCausalLM"],
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "su", **LONG_FACTORS},
    }
    scaling = read_hf_config(d).rope_scaling
    assert scaling is not None
    assert scaling["rope_type"] == "longrope" and "type" not in scaling
    assert scaling["original_max_position_embeddings"] == 4096


def test_unknown_rope_type_names_the_key() -> None:
    d = LlamaConfig(**SHAPES).to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    d["rope_parameters"] = {"rope_type": "mrope", "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="'mrope'"):
        read_hf_config(d)
