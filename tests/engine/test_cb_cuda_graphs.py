"""The CUDA-graph decode runner's forward, minus the capture, on a CPU: its static buffers filled
from a padded step and the model run over them through the Triton kernels (in Triton's
interpreter) must give the eager torch path's hidden states and cache writes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton numpy)")

from server.continuous_batching.model import build_attention_metadata, kv_cache_shape  # noqa: E402
from server.continuous_batching.runner.cuda_graphs import DecodeGraphs  # noqa: E402
from server.continuous_batching.runner.decode_buckets import DecodeInputs, pad_decode_inputs  # noqa: E402
from server.continuous_batching.runner.model_runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 8  # + the dummy block, number NUM_BLOCKS


@pytest.mark.skipif(torch.cuda.is_available(), reason="the session's model lives on the CPU")
def test_static_buffer_forward_matches_eager_padded_step(
    cb_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = cb_runner.model
    shape = kv_cache_shape(model.config, NUM_BLOCKS + 1, BLOCK_SIZE)
    caches = [
        (torch.zeros(shape), torch.zeros(shape)) for _ in range(model.config.num_hidden_layers)
    ]
    # Two prompts (5 and 20 tokens) prefilled through torch into shuffled blocks.
    tables = [[6], [3, 1]]
    prompts = [[1, 504, 3458, 282, 4649], list(range(200, 220))]
    lens = [len(p) for p in prompts]
    meta = build_attention_metadata(lens, lens, tables, BLOCK_SIZE, torch.device("cpu"))
    positions = torch.tensor([i for n in lens for i in range(n)])
    model(torch.tensor(sum(prompts, [])), positions, caches, meta)

    step = DecodeInputs(
        [42, 43], positions=lens, context_lens=[n + 1 for n in lens], block_tables=tables
    )
    padded = pad_decode_inputs(step, 4, dummy_block=NUM_BLOCKS)
    eager_caches = [(k.clone(), v.clone()) for k, v in caches]
    eager_meta = build_attention_metadata(
        [1] * 4, padded.context_lens, padded.block_tables, BLOCK_SIZE, torch.device("cpu")
    )
    ids, pos = torch.tensor(padded.input_ids), torch.tensor(padded.positions)
    want = model(ids, pos, eager_caches, eager_meta)

    graphs = DecodeGraphs(model, caches, [1, 2, 4], BLOCK_SIZE, 64, dummy_block=NUM_BLOCKS)
    graphs._fill(padded)
    assert torch.equal(graphs.slot_mapping[:4], eager_meta.slot_mapping)
    assert graphs.context_lens[:4].tolist() == [6, 21, 1, 1]
    monkeypatch.setattr(model, "attention_backend", "triton")
    got = graphs._forward(4)

    torch.testing.assert_close(got[:2], want[:2], atol=1e-4, rtol=1e-4)
    for (k, v), (want_k, want_v) in zip(caches, eager_caches, strict=True):
        torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, want_v, atol=1e-5, rtol=1e-5)
