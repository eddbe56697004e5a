"""The step scheduler: which sequences run this step, with how many tokens, and which blocks
move. Plain Python (no torch), so its rules are unit-tested in milliseconds.

Every step: running requests first (oldest first; when blocks run out the newest running
request is preempted, by swapping to the CPU pool or, when that is full, by recomputation),
then swapped requests come back in arrival order, then waiting requests are admitted in
arrival order within the token and beam budgets. Long prompts are split over steps (chunked
prefill). A request samples in a step only when all its sequences reach their last token in
that step, so beams and samples of one request always advance together.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from server.continuous_batching.scheduling.block_manager import BlockManager, BlockOps
from server.continuous_batching.sequence import GroupStatus, Sequence, SequenceGroup


@dataclass
class ScheduledSeq:
    """One sequence of the step and how many of its tokens go through the model."""

    seq: Sequence
    group: SequenceGroup
    num_query_tokens: int
    is_sampling: bool


@dataclass
class SchedulerOutput:
    """The plan of one step."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_ops: BlockOps = field(default_factory=BlockOps)
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens fed through the model this step."""
        return sum(s.num_query_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.scheduled


def _plan(group: SequenceGroup, token_budget: int) -> list[tuple[Sequence, int]] | None:
    """Tokens per live sequence this step, or None if nothing of the group fits."""
    seqs = group.live_seqs
    remaining = [s.num_uncomputed_tokens for s in seqs]
    if sum(remaining) <= token_budget:
        return list(zip(seqs, remaining, strict=True))
    # Not all can reach their end: prefill chunks, holding back each sequence's last token so
    # that the whole group samples together in a later step.
    plan = []
    for seq, num_left in zip(seqs, remaining, strict=True):
        num_tokens = min(num_left - 1, token_budget)
        if num_tokens > 0:
            plan.append((seq, num_tokens))
            token_budget -= num_tokens
    return plan or None


class Scheduler:
    """Admits, runs, preempts and resumes sequence groups within the batch limits."""

    def __init__(
        self, block_manager: BlockManager, batch_max_tokens: int, batch_max_beams: int
    ) -> None:
        self.block_manager = block_manager
        self.batch_max_tokens = batch_max_tokens
        self.batch_max_beams = batch_max_beams
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []  # kept in arrival order

    # -- queue management -----------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """True while any request is waiting, running or swapped."""
        return bool(self.waiting or self.running or self.swapped)

    def why_never_fits(self, group: SequenceGroup) -> str | None:
        """A reason this request can never be scheduled, or None."""
        bm = self.block_manager
        if group.config.num_workload_beams > self.batch_max_beams:
            return (
                f"the request decodes {group.config.num_workload_beams} sequences at once but "
                f"this server runs at most {self.batch_max_beams} (batch_max_beams)"
            )
        num_prompt = group.seqs[0].num_prompt_tokens
        assert group.config.max_new_tokens is not None
        # Prompt blocks are shared; each sequence needs its own blocks for what it generates.
        max_new = group.config.max_new_tokens
        need = bm.num_blocks_for(num_prompt) + group.config.num_workload_beams * (
            bm.num_blocks_for(max_new) + 1
        )
        held = bm.max_blocks_held(min(self.batch_max_tokens, num_prompt + max_new))
        if held is not None:  # sliding window: blocks before it are freed as it moves
            need = min(need, held * group.config.num_workload_beams)
        capacity = bm.device.num_blocks - bm.num_watermark_blocks
        if need > capacity:
            return (
                f"the request needs up to {need} KV-cache blocks but the cache has {capacity}; "
                "lower max_new_tokens, num_beams or the prompt length"
            )
        return None

    def add(self, group: SequenceGroup) -> None:
        """Queue a new request (call ``why_never_fits`` first): behind every waiting request
        of its priority or a lower value (vLLM's: lower first), in arrival order among equals.
        (A preempted request goes back to the front, whatever its priority.)"""
        group.status = GroupStatus.WAITING
        priority = group.config.priority
        if not self.waiting or self.waiting[-1].config.priority <= priority:
            self.waiting.append(group)  # the common case: no scan
            return
        index = next(i for i, g in enumerate(self.waiting) if g.config.priority > priority)
        self.waiting.insert(index, group)

    def remove(self, group: SequenceGroup) -> None:
        """Take a request out of every queue and free its blocks (finish or abort)."""
        if group in self.running:
            self.running.remove(group)
        elif group in self.swapped:
            self.swapped.remove(group)
        elif group in self.waiting:
            self.waiting.remove(group)
        for seq in group.seqs:
            self.block_manager.free(seq)
        group.status = GroupStatus.FINISHED

    # -- scheduling -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step."""
        out = SchedulerOutput()
        budget = [self.batch_max_tokens]
        scheduled_groups: set[int] = set()
        for group in list(self.running):
            if group.status is not GroupStatus.RUNNING:
                continue  # preempted earlier in this loop
            self._schedule_running(group, out, budget, scheduled_groups)
        is_preempting = out.num_swap_preemptions or out.num_recompute_preemptions
        if not is_preempting:
            self._resume_swapped(out, budget, scheduled_groups)
        if not is_preempting and not self.swapped:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(
        self, group: SequenceGroup, out: SchedulerOutput, budget: list[int], done: set[int]
    ) -> None:
        plan = _plan(group, budget[0])
        if plan is None:
            return
        bm = self.block_manager
        num_needed = sum(bm.num_new_blocks(seq, n) for seq, n in plan)
        while not bm.can_allocate(num_needed, is_admission=False):
            victim = next(g for g in reversed(self.running) if id(g) not in done)
            self._preempt(victim, out)
            if victim is group:
                return
        self._commit(group, plan, out, budget)
        done.add(id(group))

    def _commit(
        self,
        group: SequenceGroup,
        plan: list[tuple[Sequence, int]],
        out: SchedulerOutput,
        budget: list[int],
    ) -> None:
        is_sampling = all(n == seq.num_uncomputed_tokens for seq, n in plan) and len(plan) == len(
            group.live_seqs
        )
        for seq, num_tokens in plan:
            out.block_ops.copy.extend(self.block_manager.allocate_slots(seq, num_tokens))
            out.scheduled.append(ScheduledSeq(seq, group, num_tokens, is_sampling))
            budget[0] -= num_tokens

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.running.remove(group)
        group.num_preemptions += 1
        seqs = group.live_seqs
        is_decoding = all(s.num_uncomputed_tokens <= 1 for s in seqs)
        if is_decoding and self.block_manager.can_swap_out(seqs):
            out.block_ops.swap_out.update(self.block_manager.swap_out(seqs))
            group.status = GroupStatus.SWAPPED
            keys = [g.arrival_time for g in self.swapped]
            self.swapped.insert(bisect.bisect(keys, group.arrival_time), group)
            out.num_swap_preemptions += 1
            return
        for seq in seqs:  # recompute: drop the KV cache, keep the tokens
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
        group.status = GroupStatus.WAITING
        self.waiting.appendleft(group)
        out.num_recompute_preemptions += 1

    def _num_running_beams(self) -> int:
        return sum(g.num_workload_beams for g in self.running)

    def _resume_swapped(self, out: SchedulerOutput, budget: list[int], done: set[int]) -> None:
        bm = self.block_manager
        num_running_beams = self._num_running_beams()  # counted once: O(running) per step
        while self.swapped:
            group = self.swapped[0]
            seqs = group.live_seqs
            if num_running_beams + group.num_workload_beams > self.batch_max_beams:
                return
            # The blocks coming back plus one new block per sequence for its next token.
            if not bm.can_allocate(bm.num_blocks_to_swap_in(seqs) + len(seqs), is_admission=True):
                return
            self.swapped.pop(0)
            out.block_ops.swap_in.update(bm.swap_in(seqs))
            group.status = GroupStatus.RUNNING
            self.running.append(group)
            num_running_beams += group.num_workload_beams
            plan = _plan(group, budget[0])
            if plan is not None:
                self._commit(group, plan, out, budget)
                done.add(id(group))

    def _admit_waiting(self, out: SchedulerOutput, budget: list[int]) -> None:
        bm = self.block_manager
        num_running_beams = self._num_running_beams()
        while self.waiting and budget[0] > 0:
            group = self.waiting[0]
            if num_running_beams + group.num_workload_beams > self.batch_max_beams:
                return
            if not group.is_scoring_prompt:  # scoring needs every prompt position's logits
                for seq in group.live_seqs:
                    bm.claim_cached_prefix(seq)
            plan = _plan(group, budget[0])
            num_needed = sum(bm.num_new_blocks(seq, n) for seq, n in plan or [])
            if plan is None or not bm.can_allocate(num_needed, is_admission=True):
                for seq in group.live_seqs:  # give cached blocks back; retry next step
                    bm.free(seq)
                    seq.num_computed_tokens = 0
                return
            self.waiting.popleft()
            group.status = GroupStatus.RUNNING
            self.running.append(group)
            num_running_beams += group.num_workload_beams
            self._commit(group, plan, out, budget)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts after the model ran the step."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_query_tokens
            self.block_manager.register_computed(item.seq)
            self.block_manager.release_out_of_window(item.seq)
