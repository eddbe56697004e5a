"""A GPTQ Qwen3 checkpoint (AutoGPTQ v1 format, written by ``harness.gptq_writer``): q/k/v and
gate/up run as fused int4 matmuls, q_norm/k_norm load dense, and the engine's greedy tokens
equal transformers' with the dequantised weights (float32)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from harness.gptq_writer import write_checkpoint
from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.quantization.packed_linear import PackedLinear
from tests.engine.conftest import tokens_of
from tests.engine.test_families_qwen3_phi3 import build_family, level_config
from tests.support.cpu_paths import runnable_levels
from tests.support.tiny_families import hf_greedy_tokens

NUM_NEW = 12


def test_gptq_qwen3_matches_dequantised_transformers(
    tmp_path: Path, default_model_path: Path
) -> None:
    family = build_family("qwen3_untied_sharded", tmp_path / "qwen3", default_model_path)
    hf = Qwen3ForCausalLM.from_pretrained(family.path, dtype=torch.float32).eval()
    folder = tmp_path / "gptq"
    folder.mkdir()
    source = {k: v.float() for k, v in hf.state_dict().items()}
    reference = write_checkpoint(
        folder, family.path, source, fmt="gptq", group_size=32, desc_act=False
    )
    hf.load_state_dict(reference)
    expected = [hf_greedy_tokens(hf, p, NUM_NEW) for p in family.prompts[:3]]

    config = level_config(folder, runnable_levels()[-1])  # the int4 kernel where there is one
    config.model_loading_config.quantize_method = "gptq"
    engine = LLMEngine(config)
    layer = engine.runner.model.layers[0]
    # gptq_cpu_kernel auto: torch has no float32 int4 kernel, so the packed kernels run.
    assert isinstance(layer.qkv, PackedLinear) and isinstance(layer.gate_up, PackedLinear)
    torch.testing.assert_close(layer.q_norm, reference["model.layers.0.self_attn.q_norm.weight"])
    configs = [GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True)] * 3
    results = engine.generate(family.prompts[:3], configs)
    assert [tokens_of(r)[0] for r in results] == expected
