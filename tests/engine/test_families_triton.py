"""Qwen3's per-head q/k norms and Phi-3's partial rotary RoPE through the fused Triton ops,
run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, as ``test_triton_fused``): the q/k
head norms go through the Triton RMSNorm kernel ([T * heads, head_dim] rows), a partial
rotary model's RoPE takes the torch reference (the kernel rotates whole heads), decode
attention the Triton kernel. Greedy tokens equal transformers' (float32)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Before anything imports triton (transformers' model modules may): Triton reads it then.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton numpy)")

from protocol.generation import GenerationConfig  # noqa: E402
from server.continuous_batching.engine import LLMEngine  # noqa: E402
from server.continuous_batching.model import triton_fused  # noqa: E402
from server.continuous_batching.runner.model_runner import ModelRunner  # noqa: E402
from tests.engine.conftest import tokens_of  # noqa: E402
from tests.engine.test_families_qwen3_phi3 import build_family, level_config  # noqa: E402

NUM_NEW = 6


@pytest.mark.parametrize("name", ["qwen3_tied", "phi3_longrope_partial"])
def test_triton_ops_give_transformers_tokens(
    name: str, tmp_path: Path, default_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    family = build_family(name, tmp_path / name, default_model_path)
    config = level_config(family.path, "generic")
    runner = ModelRunner(config)
    calls: list[str] = []
    ops = triton_fused.TritonDecoderOps()
    norm = ops.rms_norm

    def counting_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        calls.append(f"norm {tuple(weight.shape)}")
        return norm(x, weight, eps)

    monkeypatch.setattr(ops, "rms_norm", counting_norm)
    monkeypatch.setattr(runner.model, "decoder_ops", ops)
    monkeypatch.setattr(runner.model, "attention_backend", "triton")
    monkeypatch.setattr(runner, "attention_backend", "triton")
    monkeypatch.setattr(runner, "is_padding_decodes", True)
    engine = LLMEngine(config, runner=runner)
    prompts = family.prompts[:2]
    results = engine.generate(
        prompts, [GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True)] * len(prompts)
    )
    assert [tokens_of(r)[0] for r in results] == [e[:NUM_NEW] for e in family.expected[:2]]
    head_dim = runner.model.config.head_dim
    assert (f"norm ({head_dim},)" in calls) == name.startswith("qwen3")
