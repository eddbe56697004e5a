"""Decode steps padded to CUDA-graph buckets: the plain padding code, and token parity when the
engine runs its decode steps padded (eagerly, on the CPU) against transformers."""

from __future__ import annotations

import pytest

from protocol.generation import GenerationConfig
from server.continuous_batching.engine_config import ModelLoadingConfig
from server.continuous_batching.runner.decode_buckets import (
    DecodeInputs,
    bucket_for,
    decode_buckets,
    pad_decode_inputs,
)
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.engine.conftest import NUM_NEW, assert_no_leak, tokens_of


def test_bucket_sizes() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    buckets = decode_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 3, 8, 9, 33, 64, 65)] == [
        1,
        4,
        8,
        16,
        48,
        64,
        None,
    ]
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_buckets(0)


def test_padding_rows_use_only_the_dummy_block() -> None:
    step = DecodeInputs([11, 12], [4, 20], [5, 21], [[3], [7, 9]])
    padded = pad_decode_inputs(step, 4, dummy_block=99)
    assert padded.num_seqs == 4
    assert padded.input_ids == [11, 12, 0, 0]
    assert padded.positions == [4, 20, 0, 0]
    assert padded.context_lens == [5, 21, 1, 1]
    assert padded.block_tables == [[3], [7, 9], [99], [99]]
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode_inputs(step, 1, dummy_block=99)


def test_enforce_eager_defaults_off() -> None:
    assert ModelLoadingConfig(model_name_or_path="m").enforce_eager is False
    assert ModelLoadingConfig(model_name_or_path="m", enforce_eager=True).enforce_eager


def test_cpu_runner_never_captures_graphs(cb_runner: ModelRunner) -> None:
    # The CPU's decode attention is the fused C++ kernel, or torch where it cannot be built.
    assert cb_runner.attention_backend in ("cpu", "torch")
    assert cb_runner.decode_graphs is None and not cb_runner.is_padding_decodes
    assert cb_runner.dummy_block == cb_runner.num_blocks
    assert cb_runner.kv_caches[0][0].shape[0] == (cb_runner.num_blocks + 1) * cb_runner.block_size


def test_padded_decode_matches_transformers(
    make_engine, prompts, hf_greedy, cb_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps padded to buckets (dummy rows in the dummy block) change no token; the
    dummy block's rows are written and the real sequences never see them."""
    monkeypatch.setattr(cb_runner, "is_padding_decodes", True)
    sizes: list[int] = []
    original = cb_runner._decode_padded

    def spy(padded: DecodeInputs):
        sizes.append(padded.num_seqs)
        return original(padded)

    monkeypatch.setattr(cb_runner, "_decode_padded", spy)
    dummy_k = cb_runner.kv_caches[0][0][cb_runner.dummy_block * cb_runner.block_size]
    dummy_k.zero_()
    engine = make_engine()
    # 5 and then fewer running sequences: every decode step is padded (to 8, 4, 2...).
    batch = prompts[:5]
    results = engine.generate(batch, [GenerationConfig(max_new_tokens=NUM_NEW)] * len(batch))
    for deltas, expected in zip(results, hf_greedy[:5], strict=True):
        assert tokens_of(deltas)[0] == expected
    assert sizes and all(size in cb_runner.decode_buckets for size in sizes)
    assert 8 in sizes
    assert dummy_k.abs().sum() > 0  # the padded rows did run and write their K there
    assert_no_leak(engine)
