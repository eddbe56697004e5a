"""The static-batching worker: runs one package through transformers ``generate``.

It runs in the batcher's one worker thread. Greedy and sampling packages stream: a stopping
criterion sees every row's new token at each step, detokenizes it, decides per row whether the
row is finished (EOS, stop token, stop string, its own ``max_new_tokens``, abort) and pushes the
deltas to the request's queue. It does this in the stopping criterion rather than a streamer
because transformers calls the criteria before ``streamer.put``: a stop string found in the
streamer could only end its row one (wasted, miscounted) token later.

Beam search cannot stream in transformers, so beam packages answer once, at the end.

A resumed choice (``protocol.resume``: ``SequenceRequest.resumed_token_ids``, the tokens another
server streamed before it died) continues as if this worker had generated those tokens: its row's
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

OpenAI's knobs (``logit_bias``, ``presence_penalty``, ``frequency_penalty``, ``min_p``) are
applied with the CB engine's definitions (:mod:`server.common.logit_knobs`) in vLLM's order.
transformers runs the processors a caller passes after its own processors and before its
warpers, which would put the bias after the repetition penalty and ``min_p`` after top-p; so a
package that uses the knobs gets its whole chain from the worker (transformers' own processor
and warper classes for Hugging Face's knobs), in that order. A package that uses none runs
exactly as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig as HFGenerationConfig
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from protocol.generation import FinishReason, GenerationConfig
from server.common.backend import TextDelta
from server.common.detokenizer import IncrementalDetokenizer
from server.common.logit_knobs import apply_additive_penalties, apply_logit_bias
from server.static_batching.batcher import Package, RequestState
from utils.errors import APIError

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready for ``generate`` and what the worker needs to know about it."""

    model: Any
    tokenizer: Any
    device: torch.device
    model_id: str
    max_model_len: int
    eos_token_ids: list[int]
    pad_token_id: int


@dataclass(eq=False)
class _Row:
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


class _RowTracker(StoppingCriteria):
    """Per-row stop decisions and streaming for one greedy/sampling package."""

    def __init__(self, rows: list[_Row], done: set[RequestState]) -> None:
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

    def _publish(self, results: list[tuple[_Row, TextDelta | None]]) -> None:
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


class _MinNewTokensProcessor(LogitsProcessor):
    """Keeps each row's end tokens (EOS, stop token ids) away until its ``min_new_tokens``."""

    def __init__(self, rows: list[_Row]) -> None:
        self.rows = rows

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        for i, row in enumerate(self.rows):
            is_done = row.is_finished or row.num_generated >= row.config.min_new_tokens
            if is_done or not row.end_token_ids:
                continue
            end_ids = list(row.end_token_ids)
            saved = scores[i, end_ids].clone()
            scores[i, end_ids] = -float("inf")
            if torch.isinf(scores[i]).all():
                # Earlier filters (top-k/top-p) left only end tokens: masking would leave
                # nothing to sample, so let the row end rather than fail the package.
                scores[i, end_ids] = saved
        return scores


class _LogitBiasProcessor(LogitsProcessor):
    """Each row's ``logit_bias`` (rows without one are left as they are)."""

    def __init__(self, rows: list[_Row], device: torch.device) -> None:
        pairs = [
            (i, token, bias)
            for i, row in enumerate(rows)
            for token, bias in row.config.logit_bias.items()
        ]
        # Built once: the biases do not change while the package runs.
        self.row_index = torch.tensor([i for i, _, _ in pairs], dtype=torch.long, device=device)
        self.token_index = torch.tensor([t for _, t, _ in pairs], dtype=torch.long, device=device)
        self.bias = torch.tensor([b for _, _, b in pairs], dtype=torch.float32, device=device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return apply_logit_bias(scores, self.row_index, self.token_index, self.bias)


class _AdditivePenaltiesProcessor(LogitsProcessor):
    """Each row's frequency and presence penalties over its output tokens: the columns of
    ``input_ids`` past the (left-padded) inputs, ``input_width`` of them, and, for a resumed
    row, the last ``num_resumed`` columns of its input (the tokens generated before the
    switch, which the row's input ends with)."""

    def __init__(self, rows: list[_Row], input_width: int, device: torch.device) -> None:
        penalised = [
            i
            for i, row in enumerate(rows)
            if row.config.presence_penalty != 0.0 or row.config.frequency_penalty != 0.0
        ]
        num_resumed = [rows[i].num_resumed for i in penalised]
        most_resumed = max(num_resumed, default=0)
        #: The first column read: the earliest resumed token of the penalised rows.
        self.start = input_width - most_resumed
        #: [r, most_resumed]: True where a read input column is not the row's output (the
        #: prompt, or padding), replaced by the vocabulary size (ignored) at each step.
        self.not_output = torch.tensor(
            [[j < most_resumed - n for j in range(most_resumed)] for n in num_resumed],
            dtype=torch.bool,
            device=device,
        ).reshape(len(penalised), most_resumed)
        self.rows = torch.tensor(penalised, dtype=torch.long, device=device)
        self.is_any_resumed = most_resumed > 0
        self.frequency = torch.tensor(
            [[rows[i].config.frequency_penalty] for i in penalised], device=device
        )
        self.presence = torch.tensor(
            [[rows[i].config.presence_penalty] for i in penalised], device=device
        )

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[self.rows, self.start :]  # a copy: advanced indexing
        if generated.shape[1] == 0:
            return scores  # nothing generated yet: nothing to count
        if self.is_any_resumed:
            num_read = self.not_output.shape[1]
            generated[:, :num_read].masked_fill_(self.not_output, scores.shape[1])
        scores[self.rows] = apply_additive_penalties(
            scores[self.rows], generated, self.frequency, self.presence
        )
        return scores


def _uses_logit_knobs(rows: list[_Row]) -> bool:
    """True when a row of the package uses one of OpenAI's knobs (min-p only if it samples)."""
    return any(
        row.config.logit_bias
        or row.config.presence_penalty != 0.0
        or row.config.frequency_penalty != 0.0
        or (row.config.do_sample and row.config.min_p > 0.0)
        for row in rows
    )


class _AbortCriteria(StoppingCriteria):
    """Ends a beam-search package as soon as all its requests are aborted."""

    def __init__(self, package: Package) -> None:
        self.package = package

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        is_aborted = all(state.is_aborted for state in self.package.states)
        return torch.full(
            (input_ids.shape[0],), is_aborted, dtype=torch.bool, device=input_ids.device
        )


class SBWorker:
    """Runs packages on a loaded model; ``run_package`` is called in the worker thread."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer

    def run_package(self, package: Package) -> None:
        """Generate for every request of ``package``; each gets its deltas or its own error."""
        done: set[RequestState] = set()
        try:
            with torch.inference_mode():
                if package.states[0].request.config.is_beam_search:
                    self._run_beam_search(package, done)
                else:
                    self._run_streaming(package, done)
        except Exception as exc:  # fail this package only; the worker keeps serving
            logger.exception("package %d failed", package.package_id)
            error = APIError(500, f"generation failed: {type(exc).__name__}: {exc}")
            for state in package.states:
                if state not in done:
                    state.emit(error)

    def end_token_ids(self, config: GenerationConfig) -> frozenset[int]:
        """Tokens that finish a sequence of ``config`` with reason ``stop``."""
        eos = set() if config.ignore_eos else set(self.loaded.eos_token_ids)
        return frozenset(eos | set(config.stop_token_ids))

    def _inputs(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded input ids and attention mask (decoder-only models continue on the right)."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.loaded.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[i, width - len(prompt) :] = 1
        device = self.loaded.device
        return input_ids.to(device), attention_mask.to(device)

    def _run_streaming(self, package: Package, done: set[RequestState]) -> None:
        rows: list[_Row] = []
        prompts: list[list[int]] = []
        for state in package.states:
            config = state.request.config
            # One row per choice, so that num_return_sequences may differ between requests.
            # A resumed choice's input ends with the tokens generated before the switch.
            request = state.request
            resumed = request.resumed_token_ids
            for index in range(config.num_return_sequences):
                detokenizer = IncrementalDetokenizer(self.tokenizer, config.stop)
                if resumed:
                    detokenizer.resume(resumed, request.num_resumed_text_chars)
                end_ids = self.end_token_ids(config)
                rows.append(_Row(state, index, detokenizer, end_ids, num_resumed=len(resumed)))
                prompts.append([*request.prompt_token_ids, *resumed])
        config = package.states[0].request.config
        input_ids, attention_mask = self._inputs(prompts)
        # The package key holds the warpers' and the repetition penalty's values: one config.
        sampling: dict[str, Any] = {"repetition_penalty": config.repetition_penalty}
        if config.do_sample:
            sampling.update(
                temperature=config.temperature,
                top_k=config.top_k,
                top_p=config.top_p,
                typical_p=config.typical_p,
            )
        processors = LogitsProcessorList()
        if _uses_logit_knobs(rows):
            # The worker's own chain, in vLLM's order (see the module docstring); transformers
            # is told to add nothing of its own (neutral values, set explicitly so that the
            # model's generation config does not fill them in).
            processors.extend(self._knob_processors(rows, config, input_ids.shape[1], sampling))
            sampling = {"repetition_penalty": 1.0}
            if config.do_sample:
                sampling.update(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0)
        if any(row.config.min_new_tokens > 0 and row.end_token_ids for row in rows):
            # After the penalties, before the warpers: where transformers puts a caller's
            # processors, and where the chain above leaves room for it.
            index = next(
                (i for i, p in enumerate(processors) if isinstance(p, TemperatureLogitsWarper)),
                len(processors),
            )
            processors.insert(index, _MinNewTokensProcessor(rows))
        generation_config = HFGenerationConfig(
            max_new_tokens=max(max(row.num_left, 1) for row in rows),
            do_sample=config.do_sample,
            pad_token_id=self.loaded.pad_token_id,
            # Ends of rows are decided per row by the tracker, never for the whole batch.
            eos_token_id=None,
            **sampling,
        )
        tracker = _RowTracker(rows, done)
        if config.seed is not None:
            torch.manual_seed(config.seed)  # seeded requests run alone: reproducible
        self.loaded.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            logits_processor=processors,
            stopping_criteria=StoppingCriteriaList([tracker]),
        )
        tracker.finish_open_rows()

    def _knob_processors(
        self,
        rows: list[_Row],
        config: GenerationConfig,
        input_width: int,
        sampling: dict[str, Any],
    ) -> list[LogitsProcessor]:
        """The package's processing chain when it uses OpenAI's knobs, in vLLM's order:
        ``logit_bias``, repetition penalty, frequency and presence penalties, then (sampling)
        temperature, min-p, top-k, top-p, typical-p. ``sampling`` holds the package's values
        of Hugging Face's knobs."""
        device = self.loaded.device
        chain: list[LogitsProcessor] = []
        if any(row.config.logit_bias for row in rows):
            chain.append(_LogitBiasProcessor(rows, device))
        if sampling["repetition_penalty"] != 1.0:
            chain.append(RepetitionPenaltyLogitsProcessor(sampling["repetition_penalty"]))
        if any(row.config.presence_penalty or row.config.frequency_penalty for row in rows):
            chain.append(_AdditivePenaltiesProcessor(rows, input_width, device))
        if not config.do_sample:
            return chain  # greedy: no warpers, as transformers and vLLM
        if sampling["temperature"] != 1.0:
            chain.append(TemperatureLogitsWarper(sampling["temperature"]))
        if config.min_p > 0.0:
            chain.append(MinPLogitsWarper(config.min_p))
        if sampling["top_k"]:
            chain.append(TopKLogitsWarper(sampling["top_k"]))
        if sampling["top_p"] < 1.0:
            chain.append(TopPLogitsWarper(sampling["top_p"]))
        if sampling["typical_p"] < 1.0:
            chain.append(TypicalLogitsWarper(sampling["typical_p"]))
        return chain

    def _run_beam_search(self, package: Package, done: set[RequestState]) -> None:
        # Every request of a beam package has the same config (it is all in the packing key).
        config = package.states[0].request.config
        end_ids = self.end_token_ids(config)
        generation_config = HFGenerationConfig(
            max_new_tokens=config.max_new_tokens,
            min_new_tokens=config.min_new_tokens if end_ids and config.min_new_tokens else None,
            do_sample=False,
            num_beams=config.num_beams,
            num_return_sequences=config.num_return_sequences,
            length_penalty=config.length_penalty,
            early_stopping=config.early_stopping,
            repetition_penalty=config.repetition_penalty,
            pad_token_id=self.loaded.pad_token_id,
            eos_token_id=sorted(end_ids) or None,
            stop_strings=config.stop or None,
        )
        input_ids, attention_mask = self._inputs(
            [s.request.prompt_token_ids for s in package.states]
        )
        sequences = self.loaded.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            stopping_criteria=StoppingCriteriaList([_AbortCriteria(package)]),
            tokenizer=self.tokenizer if config.stop else None,
        )
        generated = sequences[:, input_ids.shape[1] :].tolist()
        num_choices = config.num_return_sequences
        for i, state in enumerate(package.states):
            # generate groups its output by input: rows i*n .. i*n+n-1 belong to prompt i.
            rows = generated[i * num_choices : (i + 1) * num_choices]
            state.emit([self._beam_choice(state, j, ids, end_ids) for j, ids in enumerate(rows)])
            done.add(state)

    def _beam_choice(
        self, state: RequestState, index: int, token_ids: list[int], end_ids: frozenset[int]
    ) -> TextDelta:
        """One finished beam as a single delta, cut at its end token or stop string."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, state.request.config.stop)
        parts: list[str] = []
        num_tokens = 0
        reason: FinishReason = "length"
        for token_id in token_ids:
            num_tokens += 1
            if token_id in end_ids:
                reason = "stop"
                break
            parts.append(detokenizer.add_tokens([token_id]))
            if detokenizer.is_stopped:
                reason = "stop"
                break
        parts.append(detokenizer.flush())
        if state.is_aborted:
            reason = "abort"
        return TextDelta(index, "".join(parts), num_tokens, reason, token_ids[:num_tokens])
