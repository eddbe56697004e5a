"""The KV cache on a CPU: block copies coalesced into runs, a swap round trip through the pools,
the swap-out wait rule of the cuda path, and the sizing of the pool on cuda (its arithmetic,
the warm-up's plan, and the warm-up itself with the cuda figures faked). No GPU needed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from server.continuous_batching.cb_server_config import load_cb_server_config
from server.continuous_batching.engine_config import CacheConfig, EngineConfig
from server.continuous_batching.model import ModelArchConfig, kv_bytes_per_block, read_hf_config
from server.continuous_batching.runner import model_runner as model_runner_module
from server.continuous_batching.runner.kv_cache import (
    KVCache,
    block_runs,
    last_swap_out_to_wait,
    needs_swap_out_wait,
)
from server.continuous_batching.runner.kv_memory import (
    MemoryFigures,
    num_blocks_from_memory,
    warmup_query_lens,
    warmup_steps,
)
from server.continuous_batching.runner.model_runner import ModelRunner
from server.continuous_batching.scheduling.block_manager import BlockOps
from utils.config import ConfigError

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
BLOCK_SIZE = 4
MIB = 2**20
GIB = 2**30


# -- block runs -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("pairs", "runs"),
    [
        ([], []),
        ([(3, 0)], [(3, 0, 1)]),
        ([(3, 0), (4, 1), (5, 2)], [(3, 0, 3)]),
        # A gap on either side starts a new run.
        ([(3, 0), (5, 1), (6, 2), (7, 7)], [(3, 0, 1), (5, 1, 2), (7, 7, 1)]),
        ([(3, 0), (4, 2)], [(3, 0, 1), (4, 2, 1)]),
        # The order given is kept: no sorting, so descending pairs stay single blocks.
        ([(5, 1), (4, 0)], [(5, 1, 1), (4, 0, 1)]),
        ([(1, 0), (2, 1), (9, 4), (10, 5), (11, 6), (0, 2)], [(1, 0, 2), (9, 4, 3), (0, 2, 1)]),
    ],
)
def test_block_runs_coalesce_consecutive_pairs(
    pairs: list[tuple[int, int]], runs: list[tuple[int, int, int]]
) -> None:
    assert block_runs(pairs) == runs


def test_block_runs_within_one_pool_never_overlap() -> None:
    # Between two pools rows cannot overlap, so this is one run; within one pool, blocks 0-1
    # copied onto 1-2 in one slice would read rows the same copy writes.
    assert block_runs([(0, 1), (1, 2)]) == [(0, 1, 2)]
    assert block_runs([(0, 1), (1, 2)], is_same_pool=True) == [(0, 1, 1), (1, 2, 1)]
    assert block_runs([(0, 2), (1, 3), (2, 4)], is_same_pool=True) == [(0, 2, 2), (2, 4, 1)]
    assert block_runs([(0, 4), (1, 5), (2, 6)], is_same_pool=True) == [(0, 4, 3)]


# -- the swap-out wait rule (cuda path) ------------------------------------------------------
def test_needs_swap_out_wait_only_when_the_step_uses_a_swapped_out_block() -> None:
    assert not needs_swap_out_wait({3, 4}, {0, 1, 2})
    assert needs_swap_out_wait({3, 4}, {4, 9})
    assert not needs_swap_out_wait(frozenset(), {1})
    assert not needs_swap_out_wait({1}, set())


def test_last_swap_out_to_wait_picks_the_latest_needed() -> None:
    pending = [frozenset({1}), frozenset({2}), frozenset({3})]
    assert last_swap_out_to_wait(pending, [2, 7]) == 1
    assert last_swap_out_to_wait(pending, [1, 3]) == 2  # waiting for #2 covers #0 (one stream)
    assert last_swap_out_to_wait(pending, [9]) is None
    assert last_swap_out_to_wait(pending, []) is None

    def never_listed() -> Iterator[int]:
        raise AssertionError("the step's block ids were listed with nothing pending")
        yield 0

    assert last_swap_out_to_wait([], never_listed()) is None


# -- a real swap round trip on CPU tensors ---------------------------------------------------
@pytest.fixture
def tiny_arch() -> ModelArchConfig:
    return read_hf_config(TINY_LLAMA)


def block(cache: torch.Tensor, index: int) -> torch.Tensor:
    return cache[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]


def test_swap_round_trip_through_the_cpu_pool(tiny_arch: ModelArchConfig) -> None:
    kv = KVCache(tiny_arch, 8, 6, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    assert not kv.is_async and kv.dummy_block == 8
    assert kv.kv_caches[0][0].shape == (9 * BLOCK_SIZE, 2, 4)
    assert kv.cpu_kv_caches[0][0].shape == (6 * BLOCK_SIZE, 2, 4)
    assert not kv.cpu_kv_caches[0][0].is_pinned()
    torch.manual_seed(0)
    for k, v in kv.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in kv.kv_caches]

    # Device -> CPU as runs 5->2, then 1-2 -> 0-1, then 7->4: non-contiguous on both sides.
    swap_out = {5: 2, 1: 0, 2: 1, 7: 4}
    kv.apply_block_ops(BlockOps(swap_out=swap_out))
    for (k, v), (cpu_k, cpu_v) in zip(before, kv.cpu_kv_caches, strict=True):
        for dev, cpu in swap_out.items():
            assert torch.equal(block(cpu_k, cpu), block(k, dev))
            assert torch.equal(block(cpu_v, cpu), block(v, dev))

    for k, v in kv.kv_caches:  # the freed device blocks are reused and overwritten
        k[: 8 * BLOCK_SIZE].fill_(-1.0)
        v[: 8 * BLOCK_SIZE].fill_(-1.0)

    # CPU -> device, into other block ids, then copy-on-write (after the swap-in).
    swap_in = {2: 0, 0: 6, 1: 7, 4: 3}
    kv.apply_block_ops(BlockOps(swap_in=swap_in, copy=[(6, 1)]))
    cpu_to_dev = {cpu: dev for dev, cpu in swap_out.items()}
    for (k, v), (new_k, new_v) in zip(before, kv.kv_caches, strict=True):
        for cpu, dev in swap_in.items():
            assert torch.equal(block(new_k, dev), block(k, cpu_to_dev[cpu]))
            assert torch.equal(block(new_v, dev), block(v, cpu_to_dev[cpu]))
        assert torch.equal(block(new_k, 1), block(k, 1))  # 6 holds old 1: copied onto 1
        for untouched in (2, 4, 5):
            assert bool((block(new_k, untouched) == -1.0).all())
        assert torch.equal(block(new_k, 8), block(k, 8))  # the dummy block


def test_swap_out_happens_before_copy_on_write(tiny_arch: ModelArchConfig) -> None:
    kv = KVCache(tiny_arch, 4, 2, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    for i in range(4):
        for k, v in kv.kv_caches:
            block(k, i).fill_(float(i))
            block(v, i).fill_(float(i) + 0.5)
    kv.apply_block_ops(BlockOps(swap_out={3: 1}, copy=[(0, 3)]))
    for (k, v), (cpu_k, cpu_v) in zip(kv.kv_caches, kv.cpu_kv_caches, strict=True):
        assert bool((block(cpu_k, 1) == 3.0).all()) and bool((block(cpu_v, 1) == 3.5).all())
        assert bool((block(k, 3) == 0.0).all()) and bool((block(v, 3) == 0.5).all())


# -- the cuda path's stream bookkeeping, with fake streams and events --------------------------
class FakeEvent:
    def __init__(self, name: str) -> None:
        self.name = name
        self.is_done = False

    def query(self) -> bool:
        return self.is_done


class FakeStream:
    """Records what a stream is told; events are named after what the side stream did."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.num_events = 0

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def record_event(self) -> FakeEvent:
        self.num_events += 1
        return FakeEvent(f"{self.name}#{self.num_events}")

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(f"{self.name} waits for {event.name}")


def test_cuda_path_waits_only_for_the_swaps_a_step_needs(
    tiny_arch: ModelArchConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = KVCache(tiny_arch, 8, 4, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    log: list[str] = []
    compute, side = FakeStream("compute", log), FakeStream("side", log)
    kv.is_async, kv._swap_stream = True, side  # type: ignore[assignment]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    def step(ops: BlockOps, tables: list[list[int]]) -> list[str]:
        log.clear()
        kv.apply_block_ops(ops, tables)
        return list(log)

    # Blocks 3 and 4 go out; the step runs other blocks: nothing waits for the copy.
    assert step(BlockOps(swap_out={3: 0, 4: 1}), [[0, 1], [2]]) == ["side waits for compute"]
    assert step(BlockOps(), [[0, 1, 5]]) == []
    # Block 6 goes out; a later step hands block 4 to a sequence: it waits for the first
    # swap-out only, and the second (block 6) stays pending.
    assert step(BlockOps(swap_out={6: 2}), [[0]]) == ["side waits for compute"]
    assert step(BlockOps(), [[0, 4]]) == ["compute waits for side#1"]
    assert step(BlockOps(), [[0, 4]]) == []
    # A copy-on-write onto block 6 waits for its swap-out too.
    assert step(BlockOps(copy=[(0, 6)]), []) == ["compute waits for side#2"]
    # A swap-out whose event has completed is forgotten.
    step(BlockOps(swap_out={7: 3}), [[0]])
    kv._pending_swap_outs[-1][0].is_done = True  # type: ignore[attr-defined]
    assert step(BlockOps(), [[7]]) == [] and not kv._pending_swap_outs
    # Swap-ins: always waited for, and they settle every earlier swap-out (one stream).
    step(BlockOps(swap_out={5: 2}), [[0]])
    assert step(BlockOps(swap_in={0: 3, 1: 4}), [[3, 4]]) == [
        "side waits for compute",
        "compute waits for side#5",
    ]
    assert not kv._pending_swap_outs


# -- pool sizing on cuda: the arithmetic and the plan ----------------------------------------
def test_num_blocks_from_memory() -> None:
    # 90% of 80 GiB, less 10 GiB in use, in 2 MiB blocks, less the dummy block.
    assert num_blocks_from_memory(80 * GIB, 10 * GIB, 0.9, 2 * MIB) == 31 * 1024 - 1
    assert num_blocks_from_memory(100 * MIB, 50 * MIB, 1.0, 25 * MIB) == 1
    assert num_blocks_from_memory(100 * MIB, 50 * MIB, 1.0, 20 * MIB) == 1  # 2.5 blocks fit


@pytest.mark.parametrize(
    ("total", "used", "utilization"),
    [(100 * MIB, 60 * MIB, 1.0), (100 * MIB, 95 * MIB, 0.9), (100 * MIB, 90 * MIB, 0.5)],
)
def test_num_blocks_from_memory_refuses_less_than_a_block(
    total: int, used: int, utilization: float
) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization") as refused:
        num_blocks_from_memory(total, used, utilization, 25 * MIB)
    assert "cache_config.num_blocks" in str(refused.value)


def test_memory_figures_peak_in_use() -> None:
    figures = MemoryFigures(total=100, free=30, reserved=50, peak_allocated=45, warmup_pool=5)
    assert figures.outside_torch == 20  # context, workspaces, other processes
    assert figures.peak_in_use == 45 - 5 + 20
    idle = MemoryFigures(total=100, free=60, reserved=50, peak_allocated=10, warmup_pool=0)
    assert idle.outside_torch == 0
    assert "GiB total" in figures.describe()


@pytest.mark.parametrize(
    ("max_tokens", "max_beams", "max_len", "expected"),
    [
        (1024, 64, 8192, [[1024], [16] * 64]),
        (8192, 256, 2048, [[2048] * 4, [32] * 256]),
        (100, 3, 64, [[64, 36], [34, 33, 33]]),
        (16, 64, 2048, [[16], [1] * 16]),
        (50, 2, 16, [[16, 16]]),  # 2 sequences of at most 16 tokens: 32 tokens, one shape
    ],
)
def test_warmup_query_lens(
    max_tokens: int, max_beams: int, max_len: int, expected: list[list[int]]
) -> None:
    steps = warmup_query_lens(max_tokens, max_beams, max_len)
    assert steps == expected
    for lens in steps:
        assert len(lens) <= max_beams and max(lens) <= max_len
        assert sum(lens) == min(max_tokens, max_beams * max_len)


def test_warmup_steps_put_each_sequence_on_its_own_blocks() -> None:
    steps = warmup_steps(40, 2, 32, block_size=16)
    assert steps == [([32, 8], [[0, 1], [2]]), ([20, 20], [[0, 1], [2, 3]])]


# -- the warm-up itself, on a tiny random llama, with the cuda figures faked ------------------
@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    config = {k: v for k, v in TINY_LLAMA.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(folder)
    return folder


def tiny_engine_config(path: Path, **cache: object) -> EngineConfig:
    return EngineConfig.model_validate(
        {
            "model_loading_config": {
                "model_name_or_path": str(path),
                "torch_dtype": "float32",
                "cpu_kernels": False,
            },
            "batcher_config": {"batch_max_tokens": 100, "batch_max_beams": 3},
            "cache_config": {"block_size": BLOCK_SIZE, "num_blocks_cpu": 2, **cache},
        }
    )


def test_cpu_pool_is_sized_by_memory_budget(tiny_model_path: Path) -> None:
    runner = ModelRunner(tiny_engine_config(tiny_model_path, memory_budget_gb=0.001))
    bytes_per_block = kv_bytes_per_block(runner.arch, BLOCK_SIZE, torch.float32)
    assert runner.num_blocks == int(0.001 * GIB) // bytes_per_block
    assert runner.dummy_block == runner.num_blocks and runner.num_blocks_cpu == 2
    assert runner.kv_caches is runner.kv_cache.kv_caches
    assert runner.cpu_kv_caches is runner.kv_cache.cpu_kv_caches


def test_warmup_runs_the_largest_steps_on_a_temporary_pool(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_engine_config(tiny_model_path, num_blocks=3, gpu_memory_utilization=0.5)
    runner = ModelRunner(config)
    bytes_per_block = runner.kv_cache.bytes_per_block
    seen: dict[str, int] = {}
    forwards: list[list[int]] = []
    real_forward = runner._warmup_forward

    def counting_forward(query_lens: list[int], block_tables: list[list[int]]) -> None:
        forwards.append(query_lens)
        real_forward(query_lens, block_tables)

    def fake_measure(run_warmup, warmup_pool_bytes: int, device: torch.device) -> MemoryFigures:
        seen["num_warmup_blocks"] = runner.kv_cache.num_blocks
        seen["num_cpu_blocks"] = runner.kv_cache.num_blocks_cpu
        run_warmup()
        return MemoryFigures(
            total=1000 * bytes_per_block,
            free=300 * bytes_per_block,
            reserved=600 * bytes_per_block,
            peak_allocated=250 * bytes_per_block,
            warmup_pool=warmup_pool_bytes,
        )

    monkeypatch.setattr(runner, "_warmup_forward", counting_forward)
    monkeypatch.setattr(model_runner_module, "measure_cuda_memory", fake_measure)
    num_blocks = runner._num_blocks_after_warmup(config.cache_config, config.batcher_config)

    # 100 tokens as [64, 36] (64 positions: the model's limit) and as [34, 33, 33].
    assert forwards == [[64, 36], [34, 33, 33]]
    # The pool fits the bigger step: 16 + 9 blocks, or 3 x 9 blocks.
    assert seen == {"num_warmup_blocks": 27, "num_cpu_blocks": 0}
    assert not hasattr(runner, "kv_cache")  # the warm-up pool is gone before the real one
    # In use: 250 at the peak less the 28-block warm-up pool (dummy included), plus 100
    # outside torch = 322 blocks' worth; half of 1000 leaves 178, less the dummy block.
    assert num_blocks == 177


# -- config -----------------------------------------------------------------------------------
def test_gpu_memory_utilization_default_and_bounds() -> None:
    assert CacheConfig().gpu_memory_utilization == 0.9
    assert CacheConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    for bad in (0, 0.0, -0.5, 1.01, 2):
        with pytest.raises(ValidationError) as refused:
            CacheConfig(gpu_memory_utilization=bad)
        (error,) = refused.value.errors()
        assert error["loc"] == ("gpu_memory_utilization",)


@pytest.mark.parametrize("bad", [0, 1.5])
def test_config_file_refuses_bad_gpu_memory_utilization(tmp_path: Path, bad: float) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    path = tmp_path / "cb_server_config.json"
    path.write_text(
        json.dumps(
            {
                "model_loading_config": {"model_name_or_path": str(folder)},
                "cache_config": {"gpu_memory_utilization": bad},
            }
        )
    )
    with pytest.raises(ConfigError, match=r"cache_config\.gpu_memory_utilization: Input should"):
        load_cb_server_config(path)
