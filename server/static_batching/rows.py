"""One package's rows (a choice of one request each) and the stopping criteria that end them.

They run in the batcher's one worker thread. Greedy and sampling packages stream: a stopping
criterion sees every row's new token at each step, detokenizes it, decides per row whether the
row is finished (EOS, stop token, stop string, its own ``max_new_tokens``, abort) and pushes the
deltas to the request's queue. It does this in the stopping criterion rather than a streamer
because transformers calls the criteria before ``streamer.put``: a stop string found in the
streamer could only end its row one (wasted, miscounted) token later.

A resumed choice (``protocol.resume``: ``SequenceRequest.resumed_token_ids``, the tokens another
server streamed before it died) continues as if this server had generated those tokens: its row's
input is the prompt followed by them, they count toward its ``max_new_tokens`` and
``min_new_tokens`` and, as output, toward its presence and frequency penalties (the repetition
penalty covers prompt and output, so it sees them either way), and its detokenizer is primed with
them and the characters the caller has, so that the text goes on from there (held-back text and
stop strings that straddle the switch included). Only new tokens are streamed and counted in the
deltas. So a greedy row gives the undisturbed run's tokens. Seeded sampling does not: a seeded
package draws from transformers' global generator seeded once per ``generate`` call, so the
resumed draws are not the ones the first server would have made (the continuous-batching engine
keys each draw by seed, choice and position; ``generate`` has no per-step hook for that). The
answer stays whole; only its sampled continuation differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteria

from protocol.generation import FinishReason, GenerationConfig
from server.common.backend import TextDelta
from server.common.detokenizer import IncrementalDetokenizer
from server.static_batching.batcher import Package, RequestState


@dataclass(eq=False)
class Row:
    """One generated sequence of a greedy/sampling package: a choice of one request."""

    state: RequestState
    choice_index: int
    detokenizer: IncrementalDetokenizer
    end_token_ids: frozenset[int]
    #: Tokens generated here (the deltas count these).
    num_tokens: int = 0
    #: Tokens another server generated for this choice before the switch (the row's input
    #: ends with them): they count toward the row's limits as its own output.
    num_resumed: int = 0
    pending_token_ids: list[int] = field(default_factory=list)
    is_finished: bool = False

    @property
    def config(self) -> GenerationConfig:
        """The decoding parameters of the row's request."""
        return self.state.request.config

    @property
    def num_generated(self) -> int:
        """The choice's output tokens so far: resumed ones and those generated here."""
        return self.num_resumed + self.num_tokens

    @property
    def num_left(self) -> int:
        """Tokens the row may still generate here (``max_new_tokens`` less its output)."""
        assert self.config.max_new_tokens is not None
        return self.config.max_new_tokens - self.num_generated

    def step(self, token_id: int) -> TextDelta | None:
        """Take the row's next token; return a delta when there is text or the row ends."""
        self.num_tokens += 1
        self.pending_token_ids.append(token_id)
        if self.state.is_aborted:
            return self.finish("abort")
        if token_id in self.end_token_ids:
            return self.finish("stop")  # the end token is counted but never shown as text
        text = self.detokenizer.add_tokens([token_id])
        if self.detokenizer.is_stopped:
            return self.finish("stop", text)
        if self.num_left <= 0:
            return self.finish("length", text)
        # Tokens that do not make final text yet are counted in the next delta.
        return self._delta(text, None) if text else None

    def finish(self, reason: FinishReason, text: str = "") -> TextDelta:
        """End the row, releasing any text the detokenizer held back."""
        self.is_finished = True
        return self._delta(text + self.detokenizer.flush(), reason)

    def _delta(self, text: str, reason: FinishReason | None) -> TextDelta:
        token_ids, self.pending_token_ids = self.pending_token_ids, []
        return TextDelta(self.choice_index, text, len(token_ids), reason, token_ids)


class RowTracker(StoppingCriteria):
    """Per-row stop decisions and streaming for one greedy/sampling package."""

    def __init__(self, rows: list[Row], done: set[RequestState]) -> None:
        self.rows = rows
        self.done = done
        self._num_open: dict[RequestState, int] = {}
        for row in rows:
            self._num_open[row.state] = self._num_open.get(row.state, 0) + 1

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        new_tokens = input_ids[:, -1].tolist()
        results = [
            (row, row.step(token))
            for row, token in zip(self.rows, new_tokens, strict=True)
            if not row.is_finished
        ]
        self._publish(results)
        is_finished = [row.is_finished for row in self.rows]
        return torch.tensor(is_finished, dtype=torch.bool, device=input_ids.device)

    def finish_open_rows(self) -> None:
        """Close rows ``generate`` left open (it stops at the longest row's limit)."""
        self._publish(
            [
                (row, row.finish("abort" if row.state.is_aborted else "length"))
                for row in self.rows
                if not row.is_finished
            ]
        )

    def _publish(self, results: list[tuple[Row, TextDelta | None]]) -> None:
        by_state: dict[RequestState, list[TextDelta]] = {}
        for row, delta in results:
            if delta is None:
                continue
            by_state.setdefault(row.state, []).append(delta)
            if delta.finish_reason is not None:
                self._num_open[row.state] -= 1
        for state, deltas in by_state.items():
            state.emit(deltas)
            if self._num_open[state] == 0:
                self.done.add(state)


class AbortCriteria(StoppingCriteria):
    """Ends a beam-search package as soon as all its requests are aborted."""

    def __init__(self, package: Package) -> None:
        self.package = package

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        is_aborted = all(state.is_aborted for state in self.package.states)
        return torch.full(
            (input_ids.shape[0],), is_aborted, dtype=torch.bool, device=input_ids.device
        )
