"""Runs API requests on a backend: prompts in, merged text deltas out, with timeouts and metrics.

Both the native and the OpenAI-compatible routes go through ``GenerationService``; only the
response formatting differs between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from protocol.generation import GenerationConfig
from protocol.resume import StreamResume
from server.common.backend import GenerationBackend, SequenceRequest, TextDelta
from server.common.bad_words import bad_words_token_ids

# ServingSettings lives with the config it is made from; importers of this module still find it.
from server.common.config import ServingSettings as ServingSettings
from server.common.job import ChoiceResult, Job
from server.common.metrics import ServerMetrics
from server.common.prompting import PromptProcessor
from server.common.reasoning import is_splitting
from server.common.request_context import RequestRecord
from server.common.structured_output import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    OutputConstraint,
)
from server.common.tool_syntax import syntax_for
from utils.errors import APIError

logger = logging.getLogger(__name__)


def new_response_id(prefix: str) -> str:
    """A unique answer id such as ``chatcmpl-3f2a...`` (not the request id that follows a
    request through the logs: that is ``utils.request_id``'s)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class GenerationService:
    """Validates inputs against the model and runs jobs on the backend."""

    def __init__(
        self, backend: GenerationBackend, settings: ServingSettings, metrics: ServerMetrics
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.metrics = metrics
        self.prompts = PromptProcessor(
            backend.tokenizer, backend.max_model_len, settings.default_max_new_tokens
        )
        #: True when chat answers get their ``<think>`` part split out (``reasoning``).
        self.is_reasoning_split = is_splitting(settings.reasoning_parser, backend.tokenizer)
        #: How this model writes tool calls (``tool_syntax``).
        self.tool_syntax = syntax_for(
            settings.tool_call_parser, getattr(backend.tokenizer, "chat_template", None)
        )
        #: Structured output's grammars, compiled once per schema; built here, while the app
        #: is built (it walks the vocabulary once: about 0.3 s for 49k tokens), not in a request.
        self.grammars: GrammarCompiler | None = None
        #: Why structured output is not served here (None when it is).
        self.no_grammar_reason: str | None = (
            f"this {backend.kind.replace('_', '-')} server does not mask its steps; the "
            "continuous-batching server does"
        )
        if backend.is_structured_output_supported:
            eos = getattr(backend.tokenizer, "eos_token_id", None)
            try:
                self.grammars = GrammarCompiler(
                    backend.tokenizer, eos_token_ids=[eos] if isinstance(eos, int) else None
                )
                self.no_grammar_reason = None
            except Exception as exc:  # e.g. a slow tokenizer: llguidance reads fast ones only
                self.no_grammar_reason = f"this model's tokenizer cannot drive it ({exc})"
                logger.warning("structured output is off: %s", self.no_grammar_reason)

    @property
    def model_id(self) -> str:
        """The name this server answers with."""
        return self.settings.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        """Refuse a request for a model this server does not serve (404)."""
        if model and model not in self.settings.served_model_names:
            served = ", ".join(self.settings.served_model_names)
            raise APIError(
                404,
                f"model '{model}' is not served here; this server serves: {served}",
                param="model",
            )

    def make_job(
        self,
        request_id: str,
        prompts: list[list[int]],
        config: GenerationConfig,
        record: RequestRecord,
    ) -> Job:
        """Resolve ``max_new_tokens`` against each prompt's length and build the job.

        ``config`` is the request's own, parsed for this call: when every prompt gets the same
        limit (one prompt, or an explicit ``max_new_tokens``) it is set in place and shared;
        only prompts of different lengths without a limit get a copy each.
        """
        self.prompts.check_token_ids(config.stop_token_ids, "stop_token_ids")
        self.prompts.check_token_ids(list(config.logit_bias), "logit_bias")
        self.prompts.check_token_ids(config.allowed_token_ids or [], "allowed_token_ids")
        asks_logprobs = config.logprobs is not None or config.prompt_logprobs is not None
        if asks_logprobs and not self.backend.is_logprobs_supported:
            name = "logprobs" if config.logprobs is not None else "prompt_logprobs"
            raise APIError(
                400,
                f"'{name}' is not supported by this {self.backend.kind.replace('_', '-')} "
                "server; it is served by the continuous-batching server",
                param=name,
            )
        if config.priority != 0 and not self.backend.is_priority_supported:
            raise APIError(
                400,
                f"'priority' is not supported by this {self.backend.kind.replace('_', '-')} "
                "server (it admits requests in arrival order); the continuous-batching server "
                "honours it",
                param="priority",
            )
        constraint = self._output_constraint(config)
        bad_words_ids = bad_words_token_ids(self.prompts.tokenizer, config.bad_words)
        limits = [self.prompts.max_new_tokens_for(len(ids), config) for ids in prompts]
        if len(set(limits)) == 1:
            config.max_new_tokens = limits[0]
            configs = [config] * len(prompts)
        else:
            configs = [config.model_copy(update={"max_new_tokens": n}) for n in limits]
        sequences = [
            SequenceRequest(
                f"{request_id}-{i}",
                token_ids,
                resolved,
                grammar=self._matcher(constraint) if constraint is not None else None,
                bad_words_ids=bad_words_ids,
            )
            for i, (token_ids, resolved) in enumerate(zip(prompts, configs, strict=True))
        ]
        job = Job(request_id, sequences, config.num_return_sequences, record)
        record.response_id = request_id
        record.num_prompt_tokens = job.num_prompt_tokens
        record.num_choices = len(sequences) * job.num_choices_per_sequence
        return job

    def make_resumed_job(
        self, resume: StreamResume, config: GenerationConfig, record: RequestRecord
    ) -> Job:
        """The job that finishes a broken stream's choices (``protocol.resume``): one
        sequence per unfinished choice, each continuing from the tokens streamed so far."""
        if config.is_beam_search:
            raise APIError(400, "a beam search cannot be resumed", param="resume")
        prompt = self.prompts.check_token_ids(resume.prompt_token_ids, "resume.prompt_token_ids")
        # Each choice runs alone; the prompt was scored (echoed) before the switch.
        config = config.model_copy(update={"num_return_sequences": 1, "prompt_logprobs": None})
        job = self.make_job(resume.response_id, [prompt] * len(resume.choices), config, record)
        constraint = self._output_constraint(config)
        for sequence, choice in zip(job.sequences, resume.choices, strict=True):
            self.prompts.check_token_ids(choice.token_ids, "resume.choices.token_ids")
            sequence.resumed_token_ids = list(choice.token_ids)
            sequence.num_resumed_text_chars = choice.num_text_chars
            sequence.choice_index = choice.index
            if constraint is not None:
                sequence.grammar = self._matcher(constraint)
                if not all(sequence.grammar.accept(t) for t in choice.token_ids):
                    raise APIError(
                        400, "the resumed tokens do not follow the output grammar", param="resume"
                    )
        job.choice_offsets = [choice.index for choice in resume.choices]
        job.created = resume.created
        job.opened_choices = {choice.index for choice in resume.choices}
        job.num_earlier_completion_tokens = resume.num_completion_tokens
        return job

    def _output_constraint(self, config: GenerationConfig) -> OutputConstraint | None:
        """The request's structured-output constraint, its grammar compiled (cached) now, so
        that a constraint that cannot be compiled is a 400 before anything runs."""
        source = config.output_grammar
        if source is None:
            return None
        param = "structured_outputs" if config.structured_outputs else "response_format"
        if self.grammars is None:
            raise APIError(
                400,
                "structured output ('response_format' json_object or json_schema, "
                "'structured_outputs', a 'guided_*' field or a forced tool call) is not "
                f"available: {self.no_grammar_reason}",
                param=param,
            )
        constraint = OutputConstraint(*source)
        try:
            self.grammars.grammar(constraint)
        except GrammarError as exc:
            raise APIError(400, str(exc), param=param) from None
        return constraint

    def _matcher(self, constraint: OutputConstraint) -> GrammarMatcher:
        assert self.grammars is not None  # checked by _output_constraint
        return self.grammars.matcher(constraint)

    async def iter_steps(self, job: Job) -> AsyncIterator[list[TextDelta]]:
        """The job's deltas, one list per engine step of a prompt (a stream writes one event
        per list), choice indices made global (prompt i, choice j -> i*n+j).

        Raises ``APIError(504)`` when the request timeout passes.
        """
        record = job.record
        try:
            async with asyncio.timeout(self.settings.request_timeout_seconds):
                sequences = (
                    self._iter_sequence(
                        job.sequences[0], job.offset_of(0), job.num_choices_per_sequence
                    )
                    if len(job.sequences) == 1
                    else self._merge(job)
                )
                # Closed here, not by the garbage collector: an early exit aborts at once.
                async with contextlib.aclosing(sequences) as steps:
                    async for deltas in steps:
                        for delta in deltas:
                            record.num_completion_tokens += delta.num_new_tokens
                            if delta.finish_reason is not None:
                                record.finish_reasons[delta.index] = delta.finish_reason
                        yield deltas
        except TimeoutError:
            error = APIError(
                504,
                f"the request did not finish within {self.settings.request_timeout_seconds:g} s",
            )
            record.error = error.message
            raise error from None
        except APIError as exc:  # a stream's error event keeps its 200: the log line says why
            record.error = exc.message
            raise

    async def _iter_sequence(
        self, seq: SequenceRequest, offset: int, num_choices: int
    ) -> AsyncIterator[list[TextDelta]]:
        self.metrics.prompt(seq.num_prompt_tokens)
        first_token_time: float | None = None
        last_token_time = 0.0
        num_tokens = 0
        reasons: list[str] = []
        stream = self.backend.stream(seq)
        try:
            async for deltas in stream:
                for delta in deltas:
                    if delta.num_new_tokens:
                        now = time.monotonic()
                        if first_token_time is None:
                            first_token_time = now
                            self.metrics.first_token(now - seq.arrival_time)
                        else:
                            self.metrics.token_gap(now - last_token_time, delta.num_new_tokens)
                        last_token_time = now
                    if delta.finish_reason is not None:
                        reasons.append(delta.finish_reason)
                    num_tokens += delta.num_new_tokens
                    delta.index += offset
                yield deltas
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            # Choices that never finished (the caller left, a timeout, an error) were aborted.
            reasons += ["abort"] * max(0, num_choices - len(reasons))
            self.metrics.sequence_done(
                time.monotonic() - seq.arrival_time, num_tokens, first_token_time, reasons
            )

    async def _merge(self, job: Job) -> AsyncIterator[list[TextDelta]]:
        """Interleave the steps of several prompts as they come."""
        queue: asyncio.Queue[list[TextDelta] | BaseException | None] = asyncio.Queue()

        async def pump(seq: SequenceRequest, offset: int) -> None:
            try:
                async for deltas in self._iter_sequence(seq, offset, n):
                    queue.put_nowait(deltas)
                queue.put_nowait(None)
            except Exception as exc:  # handed to the consumer, which re-raises
                queue.put_nowait(exc)

        n = job.num_choices_per_sequence
        tasks = [
            asyncio.create_task(pump(seq, job.offset_of(i))) for i, seq in enumerate(job.sequences)
        ]
        try:
            num_open = len(tasks)
            while num_open:
                item = await queue.get()
                if item is None:
                    num_open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, job: Job) -> list[ChoiceResult]:
        """Run the job to the end and return every choice, ordered by index."""
        results: dict[int, ChoiceResult] = {}
        async for deltas in self.iter_steps(job):
            for delta in deltas:
                result = results.setdefault(delta.index, ChoiceResult(delta.index))
                result.text_parts.append(delta.text)
                result.num_tokens += delta.num_new_tokens
                result.token_ids.extend(delta.token_ids)
                if delta.logprobs is not None:
                    if result.logprobs is None:
                        result.logprobs = []
                    result.logprobs.extend(delta.logprobs)
                if delta.prompt_logprobs is not None:
                    result.prompt_logprobs = delta.prompt_logprobs
                if delta.finish_reason is not None:
                    result.finish_reason = delta.finish_reason
        return [results[i] for i in sorted(results)]
