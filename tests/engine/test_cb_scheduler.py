"""Block manager and scheduler rules, without a model (plain Python, milliseconds)."""

from __future__ import annotations

import random

from protocol.generation import GenerationConfig
from server.continuous_batching.scheduling.block_manager import (
    ROOT_KEY,
    BlockContent,
    BlockManager,
    BlockPool,
)
from server.continuous_batching.scheduling.scheduler import Scheduler, SchedulerOutput
from server.continuous_batching.sequence import GroupStatus, Sequence, SequenceGroup


def make_group(request_id: str, num_prompt: int, max_new: int, **config: object) -> SequenceGroup:
    tokens = [random.randrange(1000) for _ in range(num_prompt)]
    seq = Sequence(tokens, num_prompt)
    return SequenceGroup(request_id, [seq], GenerationConfig(max_new_tokens=max_new, **config))


def fake_decode(scheduler: Scheduler, plan: SchedulerOutput) -> list[SequenceGroup]:
    """What the engine does after a forward, with token 7 as every 'sampled' token."""
    scheduler.on_step_done(plan)
    finished = []
    seen: set[int] = set()
    for item in plan.scheduled:
        if not item.is_sampling or id(item.group) in seen:
            continue
        seen.add(id(item.group))
        group = item.group
        for seq in group.live_seqs:
            seq.token_ids.append(7)
            if seq.num_generated >= group.config.max_new_tokens:
                seq.finish_reason = "length"
        if all(s.is_finished for s in group.seqs):
            scheduler.remove(group)
            finished.append(group)
    return finished


def run_to_end(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    plans = []
    for _ in range(max_steps):
        if not scheduler.has_work:
            return plans
        plan = scheduler.schedule()
        plans.append(plan)
        fake_decode(scheduler, plan)
    raise AssertionError("scheduler did not finish")


def test_pool_refcounts_and_eviction() -> None:
    pool = BlockPool(2)
    a = pool.allocate()
    pool.incref(a)
    pool.decref(a)
    assert pool.num_free == 1
    content = BlockContent(ROOT_KEY, (1, 2, 3))
    pool.register(a, content)
    pool.decref(a)
    assert pool.num_free == 2 and pool.lookup(content) == a  # cached, yet counted as free
    b = pool.allocate()
    c = pool.allocate()  # evicts the cached block
    assert {b, c} == {0, 1} and pool.lookup(content) is None
    pool.decref(b)
    pool.decref(c)
    assert pool.is_all_free()


def test_fork_shares_blocks_and_copy_on_write() -> None:
    bm = BlockManager(num_blocks=8, num_blocks_cpu=4, block_size=4, enable_prefix_caching=False)
    parent = Sequence(list(range(6)), 6)
    bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork()
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert bm.num_new_blocks(child, 1) == 1  # shared half-full block must be copied
    copies = bm.allocate_slots(child, 1)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]
    assert bm.allocate_slots(parent, 1) == []  # now the parent owns its block alone
    bm.free(parent)
    bm.free(child)
    assert bm.device.is_all_free()


def test_swap_moves_shared_blocks_once() -> None:
    bm = BlockManager(num_blocks=8, num_blocks_cpu=8, block_size=4, enable_prefix_caching=False)
    a = Sequence(list(range(8)), 8)
    bm.allocate_slots(a, 8)
    b = a.fork()
    bm.fork(a, b)
    out_map = bm.swap_out([a, b])
    assert len(out_map) == 2 and bm.device.is_all_free()
    assert a.block_table == b.block_table and a.is_swapped
    in_map = bm.swap_in([a, b])
    assert len(in_map) == 2 and bm.cpu.is_all_free()
    bm.free(a)
    bm.free(b)
    assert bm.device.is_all_free()


def test_prefix_cache_reuses_full_blocks() -> None:
    bm = BlockManager(num_blocks=16, num_blocks_cpu=0, block_size=4)
    first = Sequence(list(range(10)), 10)
    bm.allocate_slots(first, 10)
    first.num_computed_tokens = 10
    bm.register_computed(first)
    second = Sequence([*range(8), 99, 98, 97], 11)
    assert bm.claim_cached_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    bm.free(first)
    bm.free(second)
    assert bm.device.num_free == 16
    # A prompt equal to a cached one still computes its last token.
    third = Sequence(list(range(8)), 8)
    assert bm.claim_cached_prefix(third) == 4
    bm.free(third)


def test_chunked_prefill_within_token_budget() -> None:
    bm = BlockManager(num_blocks=64, num_blocks_cpu=0, block_size=4)
    scheduler = Scheduler(bm, batch_max_tokens=16, batch_max_beams=8)
    scheduler.add(make_group("long", num_prompt=40, max_new=2))
    first = scheduler.schedule()
    assert first.num_tokens == 16 and not first.scheduled[0].is_sampling
    fake_decode(scheduler, first)
    plans = [first, *run_to_end(scheduler)]
    assert all(p.num_tokens <= 16 for p in plans)
    assert [p.scheduled[0].num_query_tokens for p in plans] == [16, 16, 8, 1]
    assert bm.device.num_free == 64


def test_fcfs_admission_and_beam_budget() -> None:
    bm = BlockManager(num_blocks=64, num_blocks_cpu=0, block_size=4)
    scheduler = Scheduler(bm, batch_max_tokens=64, batch_max_beams=4)
    scheduler.add(make_group("beams", 4, 3, num_beams=3))
    scheduler.add(make_group("two", 4, 3, do_sample=True, num_return_sequences=2))
    scheduler.add(make_group("one", 4, 3))
    plan = scheduler.schedule()
    # 3 beams reserved; the 2-sample request does not fit and nothing overtakes it.
    assert [s.group.request_id for s in plan.scheduled] == ["beams"]
    run_to_end(scheduler)
    assert bm.device.num_free == 64


def test_request_that_can_never_fit_is_refused() -> None:
    bm = BlockManager(num_blocks=8, num_blocks_cpu=0, block_size=4)
    scheduler = Scheduler(bm, batch_max_tokens=64, batch_max_beams=4)
    assert "batch_max_beams" in scheduler.why_never_fits(make_group("a", 4, 4, num_beams=5))
    assert "KV-cache blocks" in scheduler.why_never_fits(make_group("b", 20, 20))
    assert scheduler.why_never_fits(make_group("c", 8, 8)) is None


def test_preemption_swaps_then_recomputes_and_everything_finishes() -> None:
    random.seed(0)
    for num_cpu_blocks, expect in ((64, "swap"), (0, "recompute")):
        bm = BlockManager(num_blocks=12, num_blocks_cpu=num_cpu_blocks, block_size=4, watermark=0)
        scheduler = Scheduler(bm, batch_max_tokens=64, batch_max_beams=16)
        groups = [make_group(f"r{i}", 6, 14) for i in range(4)]
        for group in groups:
            scheduler.add(group)
        plans = run_to_end(scheduler)
        swaps = sum(p.num_swap_preemptions for p in plans)
        recomputes = sum(p.num_recompute_preemptions for p in plans)
        assert (swaps if expect == "swap" else recomputes) > 0
        if expect == "recompute":
            assert swaps == 0
        assert all(g.status is GroupStatus.FINISHED for g in groups)
        assert all(len(g.seqs[0].token_ids) == 20 for g in groups)
        assert bm.device.num_free == 12 and bm.cpu.is_all_free()


def test_abort_returns_blocks_from_every_queue() -> None:
    bm = BlockManager(num_blocks=12, num_blocks_cpu=64, block_size=4, watermark=0)
    scheduler = Scheduler(bm, batch_max_tokens=64, batch_max_beams=16)
    groups = [make_group(f"r{i}", 6, 30) for i in range(4)]
    for group in groups:
        scheduler.add(group)
    for _ in range(20):  # run until some are swapped out
        fake_decode(scheduler, scheduler.schedule())
        if scheduler.swapped:
            break
    assert scheduler.swapped and scheduler.running
    for group in groups:
        scheduler.remove(group)
    assert not scheduler.has_work
    assert bm.device.num_free == 12 and bm.cpu.is_all_free()


def test_random_mix_never_leaks() -> None:
    rng = random.Random(1)
    bm = BlockManager(num_blocks=40, num_blocks_cpu=16, block_size=4, watermark=0.05)
    scheduler = Scheduler(bm, batch_max_tokens=32, batch_max_beams=8)
    live: list[SequenceGroup] = []
    for step in range(400):
        if step < 300 and rng.random() < 0.3:
            kind = rng.choice([{}, {"do_sample": True, "num_return_sequences": 2}])
            group = make_group(f"g{step}", rng.randint(1, 20), rng.randint(1, 12), **kind)
            if scheduler.why_never_fits(group) is None:
                scheduler.add(group)
                live.append(group)
        if live and rng.random() < 0.05:
            victim = live.pop(rng.randrange(len(live)))
            if victim.status is not GroupStatus.FINISHED:
                scheduler.remove(victim)
        plan = scheduler.schedule()
        assert plan.num_tokens <= 32
        for group in fake_decode(scheduler, plan):
            if group in live:
                live.remove(group)
    run_to_end(scheduler)
    assert bm.device.num_free == 40 and bm.cpu.is_all_free()
    assert not any(bm.device.ref_counts)


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    bm = BlockManager(num_blocks=64, num_blocks_cpu=0, block_size=4)
    scheduler = Scheduler(bm, batch_max_tokens=64, batch_max_beams=1)  # one at a time
    for name, priority in [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", -1)]:
        scheduler.add(make_group(name, 4, 2, priority=priority))
    assert [g.request_id for g in scheduler.waiting] == ["c", "e", "a", "d", "b"]
    admitted: list[str] = []
    for plan in run_to_end(scheduler):
        for item in plan.scheduled:
            if item.group.request_id not in admitted:
                admitted.append(item.group.request_id)
    assert admitted == ["c", "e", "a", "d", "b"]
    assert bm.device.num_free == 64
