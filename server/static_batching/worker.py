"""The static-batching worker: runs one package through transformers ``generate``, in the
batcher's one worker thread.

Greedy and sampling packages stream, one row per choice, each ended on its own
(``server.static_batching.rows``), through the logits processors of
``server.static_batching.logits_chain`` (``min_new_tokens``, OpenAI's knobs) when a row needs
them. Beam search cannot stream in transformers, so beam packages answer once, at the end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig as HFGenerationConfig
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import TemperatureLogitsWarper

from protocol.generation import FinishReason, GenerationConfig
from server.common.backend import TextDelta
from server.common.detokenizer import IncrementalDetokenizer
from server.static_batching.batcher import Package, RequestState
from server.static_batching.logits_chain import (
    MinNewTokensProcessor,
    knob_processors,
    uses_logit_knobs,
)
from server.static_batching.rows import AbortCriteria, Row, RowTracker
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
        rows: list[Row] = []
        prompts: list[list[int]] = []
        for state in package.states:
            config = state.request.config
            # One row per choice, so that num_return_sequences may differ between requests.
            # A resumed choice's input ends with the tokens generated before the switch.
            request = state.request
            resumed = request.resumed_token_ids
            for index in range(config.num_return_sequences):
                detokenizer = IncrementalDetokenizer.for_config(self.tokenizer, config)
                if resumed:
                    detokenizer.resume(resumed, request.num_resumed_text_chars)
                end_ids = self.end_token_ids(config)
                rows.append(Row(state, index, detokenizer, end_ids, num_resumed=len(resumed)))
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
        if uses_logit_knobs(rows):
            # The worker's own chain, in vLLM's order (see the module docstring); transformers
            # is told to add nothing of its own (neutral values, set explicitly so that the
            # model's generation config does not fill them in).
            processors.extend(
                knob_processors(rows, config, input_ids.shape[1], sampling, self.loaded.device)
            )
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
            processors.insert(index, MinNewTokensProcessor(rows))
        generation_config = HFGenerationConfig(
            max_new_tokens=max(max(row.num_left, 1) for row in rows),
            do_sample=config.do_sample,
            pad_token_id=self.loaded.pad_token_id,
            # Ends of rows are decided per row by the tracker, never for the whole batch.
            eos_token_id=None,
            **sampling,
        )
        tracker = RowTracker(rows, done)
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
            stopping_criteria=StoppingCriteriaList([AbortCriteria(package)]),
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
        detokenizer = IncrementalDetokenizer.for_config(self.tokenizer, state.request.config)
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
