"""Prefix-cache keys that collide must be misses: never another prompt's KV blocks.

The key function is monkeypatched to collide on purpose, first in the block manager alone
(milliseconds), then in the engine with the default model, whose greedy tokens must equal a run
without the prefix cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.runner.model_runner import ModelRunner
from server.continuous_batching.scheduling import block_manager
from server.continuous_batching.scheduling.block_manager import ROOT_KEY, BlockManager, content_key
from server.continuous_batching.sequence import Sequence
from tests.support.default_model import engine_config

BLOCK = 4


def constant_key(parent_key: bytes, token_ids: tuple[int, ...]) -> bytes:
    """Every block gets the same key."""
    return b"collision"


def key_without_parent(parent_key: bytes, token_ids: tuple[int, ...]) -> bytes:
    """Equal token ids get equal keys whatever came before them."""
    return content_key(ROOT_KEY, token_ids)


def computed(bm: BlockManager, token_ids: list[int]) -> Sequence:
    """A sequence whose tokens are all in the cache and registered, as after its prefill."""
    seq = Sequence(list(token_ids), len(token_ids))
    bm.claim_cached_prefix(seq)
    bm.allocate_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed(seq)
    return seq


def test_blocks_with_a_colliding_key_are_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager, "content_key", constant_key)
    bm = BlockManager(num_blocks=16, num_blocks_cpu=0, block_size=BLOCK)
    first = computed(bm, list(range(10)))
    other = Sequence(list(range(50, 60)), 10)
    assert bm.claim_cached_prefix(other) == 0 and other.block_table == []
    assert bm.device.num_key_collisions > 0
    # The check refuses only other content: the same prompt still reuses the cached block.
    same = Sequence(list(range(10)), 10)
    assert bm.claim_cached_prefix(same) == BLOCK
    assert same.block_table == first.block_table[:1]


def test_same_tokens_after_another_prefix_are_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager, "content_key", key_without_parent)
    bm = BlockManager(num_blocks=16, num_blocks_cpu=0, block_size=BLOCK)
    shared = [7, 8, 9, 10]
    a_first = computed(bm, [1, 2, 3, 4, *shared, 99])
    c_first = computed(bm, [5, 6, 7, 8, *shared, 98])
    # Block 1 of both has the same tokens and (with this key function) the same key, but its
    # KV depends on block 0: a prompt starting like c_first may reuse c_first's block 0 only.
    again = Sequence([5, 6, 7, 8, *shared, 97], 9)
    assert bm.claim_cached_prefix(again) == BLOCK
    assert again.block_table == c_first.block_table[:1]
    assert a_first.block_table[1] not in again.block_table


@pytest.fixture
def make_engine(default_model_path: Path, cb_runner: ModelRunner):
    def build(enable_prefix_caching: bool) -> LLMEngine:
        config = engine_config(
            default_model_path, num_blocks=64, enable_prefix_caching=enable_prefix_caching
        )
        return LLMEngine(config, runner=cb_runner)

    return build


@pytest.mark.parametrize("key_function", [constant_key, key_without_parent])
def test_engine_tokens_are_right_despite_colliding_keys(
    make_engine, monkeypatch: pytest.MonkeyPatch, key_function
) -> None:
    reference = make_engine(False)
    text = (
        "The history of the city goes back to a small fishing village on the river, where "
        "traders from the north met farmers from the valley every spring to exchange goods. "
        "Over the centuries the village grew into a market town, then into a port, and today "
        "its old harbour is a museum that tells the story of those first traders."
    )
    ids = reference.tokenizer(text).input_ids
    head_a, head_b, middle = ids[0:16], ids[16:32], ids[32:48]
    prompts = [
        head_a + middle + ids[48:52],
        head_b + middle + ids[52:56],  # prompt 0's second block after another first block
        head_b + head_a + ids[56:60],  # prompt 1's first block, then prompt 0's first block
    ]
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    expected = [
        [t for d in deltas for t in d.token_ids]
        for deltas in reference.generate(prompts, [config] * len(prompts))
    ]
    monkeypatch.setattr(block_manager, "content_key", key_function)
    engine = make_engine(True)
    got = []
    for prompt in prompts:  # one at a time: each sees the blocks the previous ones cached
        (deltas,) = engine.generate([prompt], [config])
        got.append([t for d in deltas for t in d.token_ids])
    assert got == expected
    assert engine.block_manager.device.num_key_collisions > 0
