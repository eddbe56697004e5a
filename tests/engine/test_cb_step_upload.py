"""A step's arrays reach the device in one copy (the cuda path, run here on the CPU with packing
turned on): the packed tensors equal the arrays, the static decode buffers hold what a padded
step wrote, and the engine gives transformers' tokens with every step uploaded packed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.generation import GenerationConfig
from server.continuous_batching.runner.model_runner import ModelRunner
from server.continuous_batching.step_upload import (
    StaticDecodeBuffers,
    StepUploader,
    packed_offsets,
)
from tests.engine.conftest import NUM_NEW, assert_no_leak, tokens_of

CPU = torch.device("cpu")


def test_offsets_are_aligned_and_cover_every_array() -> None:
    arrays = [np.zeros(3, np.int32), np.zeros((2, 2), bool), np.zeros(0, np.int64), np.ones(5)]
    offsets, total = packed_offsets(arrays)
    assert offsets == [0, 16, 24, 24]
    assert total == 64
    assert all(offset % 8 == 0 for offset in offsets)


def test_packed_upload_gives_the_arrays_back() -> None:
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(0, 1000, 7, dtype=np.int64),
        rng.integers(-5, 5, (3, 5), dtype=np.int32),  # 60 bytes: the next offset is padded
        rng.random((2, 1, 3, 4)) > 0.5,
        np.zeros(0, dtype=np.int64),
        np.asfortranarray(rng.integers(0, 9, (4, 3), dtype=np.int64)),  # made contiguous
        rng.integers(0, 1000, 1, dtype=np.int64),
    ]
    packed = StepUploader(CPU, is_packing=True).upload(arrays)
    plain = StepUploader(CPU).upload(arrays)
    assert not StepUploader(CPU).is_packing
    for array, got, want in zip(arrays, packed, plain, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape == array.shape
        assert torch.equal(got, want)
    # The packed tensors are views of one buffer, one after another.
    assert packed[1].untyped_storage().data_ptr() == packed[0].untyped_storage().data_ptr()


def test_static_decode_buffers_take_a_step_in_one_copy() -> None:
    buffers = StaticDecodeBuffers(
        num_rows=4, max_blocks=3, block_size=16, dummy_block=99, device=CPU
    )
    buffers.fill([11, 12, 13, 0], [4, 20, 40, 0], [5, 21, 41, 1], [[3], [7, 9], [1, 2, 5], [99]])
    assert buffers.input_ids.tolist() == [11, 12, 13, 0]
    assert buffers.positions.tolist() == [4, 20, 40, 0]
    # slot = block holding the position * block_size + offset in it
    assert buffers.slot_mapping.tolist() == [3 * 16 + 4, 9 * 16 + 4, 5 * 16 + 8, 99 * 16]
    assert buffers.context_lens.tolist() == [5, 21, 41, 1]
    assert buffers.block_tables.tolist() == [[3, 99, 99], [7, 9, 99], [1, 2, 5], [99, 99, 99]]
    # A smaller step rewrites its own rows; the block tables of the rows past it are not copied.
    buffers.fill([21], [17], [18], [[4, 6]])
    assert buffers.input_ids[0] == 21 and buffers.slot_mapping[0] == 6 * 16 + 1
    assert buffers.block_tables.tolist()[:2] == [[4, 6, 99], [7, 9, 99]]
    # The staging buffer is reused, not fresh: what the last step wrote there must not leak.
    assert buffers.input_ids.tolist()[1:] == [0, 0, 0]
    assert buffers.context_lens.tolist()[1:] == [0, 0, 0]
    with pytest.raises(ValueError, match="do not fit"):
        buffers.fill([1] * 5, [0] * 5, [1] * 5, [[0]] * 5)


@pytest.mark.parametrize("backend", ["torch", "kernel"])
def test_packed_steps_give_transformers_tokens(
    make_engine,
    prompts,
    hf_greedy,
    cb_runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
) -> None:
    """Every step's arrays uploaded packed, through the torch attention path (groups, masks,
    output index: the most arrays) or the runner's own kernel path."""
    monkeypatch.setattr(cb_runner, "uploader", StepUploader(CPU, is_packing=True))
    if backend == "torch":
        monkeypatch.setattr(cb_runner, "attention_backend", "torch")
    calls: list[int] = []
    original = cb_runner.uploader.upload

    def spy(arrays: list[np.ndarray]) -> list[torch.Tensor]:
        calls.append(len(arrays))
        return original(arrays)

    monkeypatch.setattr(cb_runner.uploader, "upload", spy)
    # A small token budget splits the longest prompt into chunks: mixed prefill/decode steps.
    engine = make_engine(batch_max_tokens=32)
    batch = prompts[:3]
    results = engine.generate(batch, [GenerationConfig(max_new_tokens=NUM_NEW)] * len(batch))
    for deltas, expected in zip(results, hf_greedy[:3], strict=True):
        assert tokens_of(deltas)[0] == expected
    assert len(calls) == engine.stats.num_steps  # one upload per step
    if backend == "torch":
        assert max(calls) > 5  # a step with attention groups went up in that one copy too
    assert_no_leak(engine)
