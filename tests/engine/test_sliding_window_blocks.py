"""Sliding-window block freeing in the block manager and scheduler (plain Python, milliseconds).

With every layer sliding, blocks wholly before the window are freed after each step
(``BlockManager.release_out_of_window``), so a long sequence's blocks stay bounded; freed
entries read ``NULL_BLOCK`` and every other rule (prefix caching, forks, swapping) skips them.
"""

from __future__ import annotations

from server.continuous_batching.model.families import read_hf_config
from server.continuous_batching.scheduling.block_manager import NULL_BLOCK, BlockManager
from server.continuous_batching.scheduling.scheduler import Scheduler
from server.continuous_batching.sequence import Sequence
from tests.engine.test_cb_scheduler import fake_decode, make_group, run_to_end

WINDOW = 8
BLOCK = 4


def live(seq: Sequence) -> list[int]:
    return [b for b in seq.block_table if b != NULL_BLOCK]


def computed(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """Allocate, 'compute' and register ``num_tokens`` more tokens, then release as a step."""
    bm.allocate_slots(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    bm.register_computed(seq)
    bm.release_out_of_window(seq)


def test_blocks_before_the_window_are_freed_as_a_prefix() -> None:
    bm = BlockManager(16, 0, BLOCK, enable_prefix_caching=False, sliding_window=WINDOW)
    seq = Sequence(list(range(40)), 40)
    computed(bm, seq, 10)
    # The next query (position 10) attends 3..10: block 0 (0..3) is still needed.
    assert NULL_BLOCK not in seq.block_table and len(seq.block_table) == 3
    computed(bm, seq, 1)
    # Position 11 attends 4..11: block 0 is freed, its index kept as a placeholder.
    assert seq.block_table[0] == NULL_BLOCK and len(live(seq)) == 2
    assert bm.device.num_free == 16 - 2
    computed(bm, seq, 13)  # position 24 attends 17..24: blocks 0..3 are gone
    assert seq.block_table[:4] == [NULL_BLOCK] * 4 and len(live(seq)) == 2
    bm.free(seq)
    assert bm.device.is_all_free()


def test_without_window_nothing_is_freed() -> None:
    bm = BlockManager(16, 0, BLOCK, enable_prefix_caching=False)
    seq = Sequence(list(range(40)), 40)
    computed(bm, seq, 30)
    assert len(live(seq)) == 8 and bm.max_blocks_held(1) is None


def test_long_generation_holds_a_bounded_number_of_blocks() -> None:
    # A 5-token prompt generating 200 tokens with a 10-block pool: impossible without the
    # window (55 blocks), and never more than ceil(window / block) + 1 blocks held.
    bm = BlockManager(10, 0, BLOCK, watermark=0, sliding_window=WINDOW)
    scheduler = Scheduler(bm, batch_max_tokens=16, batch_max_beams=4)
    group = make_group("long", 5, 200)
    assert scheduler.why_never_fits(group) is None
    scheduler.add(group)
    seq = group.seqs[0]
    most = 0
    while scheduler.has_work:
        plan = scheduler.schedule()
        assert plan.num_recompute_preemptions == plan.num_swap_preemptions == 0
        most = max(most, len(live(seq)))
        fake_decode(scheduler, plan)
    assert seq.num_generated == 200
    assert most == -(-WINDOW // BLOCK) + 1
    assert bm.device.is_all_free()


def test_why_never_fits_counts_the_window_only() -> None:
    bm = BlockManager(10, 0, BLOCK, watermark=0)
    scheduler = Scheduler(bm, batch_max_tokens=16, batch_max_beams=4)
    assert scheduler.why_never_fits(make_group("a", 5, 200)) is not None
    bm.sliding_window = WINDOW
    assert scheduler.why_never_fits(make_group("a", 5, 200)) is None
    # A prompt step of 16 tokens plus the window's 7 before it does not fit 5 blocks.
    small = Scheduler(BlockManager(5, 0, BLOCK, watermark=0, sliding_window=WINDOW), 16, 4)
    assert small.why_never_fits(make_group("a", 40, 10)) is not None


def test_freed_cached_blocks_stay_consistent_prefix_cache() -> None:
    bm = BlockManager(32, 0, BLOCK, sliding_window=WINDOW)
    first = Sequence(list(range(30)), 30)
    computed(bm, first, 29)
    freed = 5  # position 29 attends 22..29: blocks 0..4 (positions 0..19) are freed
    assert first.block_table[:freed] == [NULL_BLOCK] * freed
    # A later request with the same prompt claims the freed blocks still cached: each holds
    # exactly the tokens its key names (registered before it was freed, never rewritten).
    second = Sequence(list(range(30)), 30)
    assert bm.claim_cached_prefix(second) == 28
    for index, block in enumerate(second.block_table):
        content = bm.device._content_of_block[block]
        assert content.token_ids == tuple(range(index * BLOCK, (index + 1) * BLOCK))
    # Claimed blocks before its window are freed after its first step.
    computed(bm, second, 1)
    assert second.block_table[:freed] == [NULL_BLOCK] * freed
    # A freed block that gets evicted and rewritten drops its key: a third request misses.
    taken = [bm.device.allocate() for _ in range(bm.device.num_free)]
    third = Sequence(list(range(30)), 30)
    assert bm.claim_cached_prefix(third) == 0
    for block in taken:
        bm.device.decref(block)
    for seq in (first, second, third):
        bm.free(seq)
    assert bm.device.num_free == 32 and not any(bm.device.ref_counts)


def test_forks_and_swaps_move_only_live_blocks() -> None:
    bm = BlockManager(16, 16, BLOCK, enable_prefix_caching=False, sliding_window=WINDOW)
    parent = Sequence(list(range(30)), 30)
    computed(bm, parent, 22)  # position 22 attends 15..22: blocks 0..2 freed
    assert parent.block_table[:3] == [NULL_BLOCK] * 3 and len(live(parent)) == 3
    child = parent.fork()
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert bm.num_new_blocks(child, 1) == 1  # the shared half-full block is copied on write
    assert bm.can_swap_out([parent, child])
    out_map = bm.swap_out([parent, child])
    assert len(out_map) == 3 and bm.device.is_all_free()
    assert parent.block_table[:3] == [NULL_BLOCK] * 3
    assert bm.num_blocks_to_swap_in([parent, child]) == 3
    in_map = bm.swap_in([parent, child])
    assert len(in_map) == 3 and bm.cpu.is_all_free()
    assert parent.block_table == child.block_table and parent.block_table[:3] == [NULL_BLOCK] * 3
    copies = bm.allocate_slots(child, 1)
    assert len(copies) == 1 and child.block_table[:3] == [NULL_BLOCK] * 3
    bm.free(parent)
    bm.free(child)
    assert bm.device.is_all_free() and bm.cpu.is_all_free()


def test_preempted_windowed_requests_finish_without_leaks() -> None:
    # More work than blocks: requests are preempted (swapped with their live blocks only, or
    # recomputed) and still all finish, with every block returned.
    bm = BlockManager(12, 6, BLOCK, watermark=0, sliding_window=WINDOW)
    scheduler = Scheduler(bm, batch_max_tokens=12, batch_max_beams=8)
    groups = [make_group(f"r{i}", 3 + 7 * i, 30) for i in range(5)]
    for group in groups:
        assert scheduler.why_never_fits(group) is None
        scheduler.add(group)
    plans = run_to_end(scheduler)
    assert sum(p.num_swap_preemptions + p.num_recompute_preemptions for p in plans) > 0
    assert all(g.seqs[0].num_generated == 30 for g in groups)
    assert bm.device.is_all_free() and bm.cpu.is_all_free()


def test_config_readers_follow_transformers_windows() -> None:
    from transformers import MistralConfig, Qwen2Config

    sizes = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32}
    sizes.update(num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1)
    mistral = read_hf_config(
        {"architectures": ["MistralForCausalLM"], **sizes, "sliding_window": 12}
    )
    assert [mistral.window_of(i) for i in range(4)] == [12] * 4
    assert MistralConfig(**sizes, sliding_window=12).sliding_window == 12
    full = read_hf_config(
        {"architectures": ["MistralForCausalLM"], **sizes, "sliding_window": None}
    )
    assert full.window_of(0) is None
    for use, first in ((True, 2), (False, 2), (True, 0)):
        qwen = {**sizes, "use_sliding_window": use, "sliding_window": 6, "max_window_layers": first}
        hf = Qwen2Config(**qwen)
        ours = read_hf_config({"architectures": ["Qwen2ForCausalLM"], **qwen})
        expected = [
            hf.sliding_window if hf.layer_types[i] == "sliding_attention" else None
            for i in range(4)
        ]
        assert [ours.window_of(i) for i in range(4)] == expected, (use, first)
    llama = read_hf_config({"architectures": ["LlamaForCausalLM"], **sizes, "sliding_window": 5})
    assert llama.window_of(0) is None
