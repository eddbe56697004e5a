"""The continuous-batching engine: ``add_request`` / ``step`` / ``abort``.

One ``step`` = schedule (plain Python) -> one forward over every scheduled token (model
runner) -> choose tokens and apply stop rules (decoder). Single-threaded; the async front
(``async_engine``) drives it from its own thread. On a GPU the forward runs asynchronously, and
the step makes the previous step's text (detokenisation, stop strings) while it computes
(``overlap_detokenization``).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer

from protocol.generation import GenerationConfig
from server.common.backend import SequenceRequest, TextDelta
from server.continuous_batching.decoding.decoder import Decoder, RequestOutput, StepTokens
from server.continuous_batching.engine_config import EngineConfig, ModelLoadingConfig
from server.continuous_batching.load_cache import cache_root, source_key
from server.continuous_batching.model.architecture import ModelArchConfig
from server.continuous_batching.model.gguf_file import GGUFFile
from server.continuous_batching.runner.model_runner import ModelRunner
from server.continuous_batching.sampling.sampler import LogitsSampler
from server.continuous_batching.scheduling.block_manager import BlockManager
from server.continuous_batching.scheduling.scheduler import Scheduler
from server.continuous_batching.sequence import Sequence, SequenceGroup

logger = logging.getLogger(__name__)


class EngineError(Exception):
    """A request the engine refuses; ``status_code`` says how (400 never fits, 503 full)."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message


@dataclass
class EngineStats:
    """Counters for metrics and tests."""

    num_steps: int = 0
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    num_generated_tokens: int = 0


def load_tokenizer(config: ModelLoadingConfig) -> tuple[Any, Path]:
    """The tokenizer, and the folder whose ``generation_config.json`` gives the EOS ids.

    ``tokenizer_name_or_path`` if set, else the model folder; GGUF weights without a tokenizer
    folder use the tokenizer embedded in the GGUF file (transformers converts it, once:
    ``gguf_tokenizer`` keeps the result).
    ``use_fast_tokenizer`` and ``trust_remote_code`` go to ``AutoTokenizer`` as they are.
    """
    options: dict[str, Any] = {
        "use_fast": config.use_fast_tokenizer,
        "trust_remote_code": config.trust_remote_code,
        "local_files_only": True,
    }
    gguf = config.gguf_path
    model_path = config.model_name_or_path
    tokenizer_path = config.tokenizer_name_or_path
    if tokenizer_path:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, **options)
        return tokenizer, Path(tokenizer_path if gguf is not None else model_path)
    if gguf is not None:
        tokenizer = gguf_tokenizer(gguf, cache_root(config.load_cache_dir), options)
        return tokenizer, gguf.parent
    return AutoTokenizer.from_pretrained(model_path, **options), Path(model_path)


def gguf_tokenizer(gguf: Path, root: Path, options: dict[str, Any]) -> Any:
    """The tokenizer embedded in ``gguf`` (transformers converts it; the chat template is the
    file's ``tokenizer.chat_template``), saved under ``<root>/tokenizers/`` after the first
    conversion and loaded from there afterwards."""
    folder = root / "tokenizers" / f"{gguf.stem}-{source_key(gguf, transformers.__version__)}"
    if (folder / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(folder), **options)
        except (OSError, ValueError) as error:
            logger.warning("ignoring damaged cached tokenizer %s: %s", folder, error)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **options)
    if not getattr(tokenizer, "chat_template", None):
        # transformers leaves the file's template out; llama.cpp and Ollama chat with it.
        tokenizer.chat_template = GGUFFile(gguf).value("tokenizer.chat_template")
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        shutil.rmtree(folder, ignore_errors=True)  # a damaged entry
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(folder)
    except OSError as error:
        logger.warning("tokenizer of %s not cached in %s: %s", gguf, folder, error)
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def load_eos_token_ids(model_path: str | Path, tokenizer: Any) -> list[int]:
    """EOS ids from the checkpoint's generation config, else the tokenizer's."""
    ids: list[int] = []
    path = Path(model_path) / "generation_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
        ids = [value] if isinstance(value, int) else list(value or [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return ids


def freeing_window(arch: ModelArchConfig) -> int | None:
    """The window before which KV blocks may be freed: the widest layer window when every
    layer slides; None when any layer attends in full (Gemma 3 mixes both: its sliding
    layers' memory is then not bounded either, as the cache is shared by all layers)."""
    windows = [arch.window_of(i) for i in range(arch.num_hidden_layers)]
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


class LLMEngine:
    """Runs many requests together, step by step, over a paged KV cache."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        """``runner``: an already loaded model (tests, benchmarks), the one ``config`` names."""
        self.config = config
        self.runner = runner or ModelRunner(config)
        self.tokenizer, metadata_dir = load_tokenizer(config.model_loading_config)
        self.eos_token_ids = load_eos_token_ids(metadata_dir, self.tokenizer)
        self.max_model_len = self.runner.max_model_len
        cache = config.cache_config
        # A shared runner (tests, benchmarks) may hold bigger pools than this engine uses.
        num_blocks = min(cache.num_blocks or self.runner.num_blocks, self.runner.num_blocks)
        num_blocks_cpu = min(cache.num_blocks_cpu, self.runner.num_blocks_cpu)
        self.block_manager = BlockManager(
            num_blocks=num_blocks,
            num_blocks_cpu=num_blocks_cpu,
            block_size=cache.block_size,
            watermark=cache.watermark,
            enable_prefix_caching=cache.enable_prefix_caching,
            sliding_window=freeing_window(self.runner.arch),
        )
        batcher = config.batcher_config
        self.scheduler = Scheduler(
            self.block_manager, batcher.batch_max_tokens, batcher.batch_max_beams
        )
        self.decoder = Decoder(
            self.tokenizer, self.block_manager, self.eos_token_ids, LogitsSampler()
        )
        self.groups: dict[str, SequenceGroup] = {}
        self.stats = EngineStats()
        overlap = batcher.overlap_detokenization
        #: Make step N's text while step N+1 runs on the device (see ``step``); on a CPU the
        #: forward runs on the host itself, so it would only hold the text back a step.
        self.is_overlapping = self.runner.device.type == "cuda" if overlap is None else overlap
        self._pending_text = StepTokens()
        # Everything loaded so far (torch, transformers, the tokenizer: millions of objects)
        # lives as long as the process; frozen, the collector stops walking it in the full
        # collections that the per-step garbage triggers (~2% of a decode step here).
        gc.collect()
        gc.freeze()

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request: SequenceRequest) -> None:
        """Queue a request; raises ``EngineError`` if it can never run or the queue is full."""
        config = request.config
        if request.request_id in self.groups:
            raise EngineError(400, f"request id {request.request_id!r} is already running")
        if not request.prompt_token_ids:
            raise EngineError(400, "the prompt is empty")
        if config.max_new_tokens is None:
            raise EngineError(400, "max_new_tokens must be set")
        if len(request.resumed_token_ids) >= config.max_new_tokens:
            raise EngineError(400, "the resumed choice has no token left to generate")
        if request.num_prompt_tokens + config.max_new_tokens > self.max_model_len:
            raise EngineError(
                400,
                f"prompt ({request.num_prompt_tokens} tokens) plus max_new_tokens "
                f"({config.max_new_tokens}) exceeds the context of {self.max_model_len} tokens",
            )
        if len(self.scheduler.waiting) >= self.config.batcher_config.max_num_waiting:
            raise EngineError(503, "the engine's queue is full; retry later")
        # The sequence's own token list: it grows, the request's prompt stays as sent. A
        # resumed choice starts with the tokens generated elsewhere, as its own output.
        token_ids = [*request.prompt_token_ids, *request.resumed_token_ids]
        seq = Sequence(token_ids, request.num_prompt_tokens)
        seq.grammar = request.grammar
        group = SequenceGroup(request.request_id, [seq], config, request.arrival_time)
        group.choice_offset = request.choice_index
        group.bad_words_ids = request.bad_words_ids
        reason = self.scheduler.why_never_fits(group)
        if reason is not None:
            raise EngineError(400, reason)
        self.decoder.start(group)
        if request.resumed_token_ids:
            self.decoder.resume(seq, request.resumed_token_ids, request.num_resumed_text_chars)
        self.groups[request.request_id] = group
        self.scheduler.add(group)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its closing output, if it existed."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        self.scheduler.remove(group)
        self._pending_text.drop(group)
        finished = {s.choice_index for s in group.seqs if s.is_finished}
        num_choices = group.config.num_return_sequences
        deltas = [
            TextDelta(index=i, text="", num_new_tokens=0, finish_reason="abort")
            for i in range(num_choices)
            if group.is_beam_search or i not in finished
        ]
        return RequestOutput(request_id, deltas, is_finished=True)

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued or running."""
        return bool(self.groups)

    # -- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and one forward; return what each request produced."""
        plan = self.scheduler.schedule()
        self.stats.num_swap_preemptions += plan.num_swap_preemptions
        self.stats.num_recompute_preemptions += plan.num_recompute_preemptions
        # With overlap on, the text of the step before this one is made while this one's
        # forward runs on the device; otherwise it was made at the end of its own step.
        pending, self._pending_text = self._pending_text, StepTokens()
        if plan.is_empty:
            if self.groups and not plan.block_ops.swap_out and not pending.groups:
                logger.warning("nothing schedulable with %d requests queued", len(self.groups))
            self.runner.apply_block_ops(plan.block_ops)
            return self._retire(self.decoder.finish_text(pending))
        logits = self.runner.execute(plan)
        for scores in self.runner.prompt_scores:
            scores.group.add_prompt_logprobs(scores.first_position, scores.entries)
        self.scheduler.on_step_done(plan)
        self.stats.num_steps += 1
        outputs = self.decoder.finish_text(pending)
        sampling: list[tuple[SequenceGroup, list[Sequence]]] = []
        for item in plan.scheduled:
            if not item.is_sampling:
                continue
            if sampling and sampling[-1][0] is item.group:
                sampling[-1][1].append(item.seq)
            else:
                sampling.append((item.group, [item.seq]))
        if sampling:
            tokens = self.decoder.collect(self.decoder.launch(sampling, logits))
            for group in tokens.finished:
                self.scheduler.remove(group)  # nothing more to run; its text may still come
            outputs += tokens.outputs
            if self.is_overlapping:
                self._pending_text = tokens
            else:
                outputs += self.decoder.finish_text(tokens)
        return self._retire(outputs)

    def _retire(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Count the outputs' tokens and let go of the requests they finish."""
        for output in outputs:
            self.stats.num_generated_tokens += sum(d.num_new_tokens for d in output.deltas)
            if output.is_finished:
                group = self.groups.pop(output.request_id, None)
                if group is not None:
                    self.scheduler.remove(group)
        return outputs

    def generate(
        self, prompts: list[list[int]], configs: list[GenerationConfig]
    ) -> list[list[TextDelta]]:
        """Offline helper: run every prompt to the end; the deltas of each, in order."""
        results: dict[str, list[TextDelta]] = {}
        for i, (prompt, config) in enumerate(zip(prompts, configs, strict=True)):
            self.add_request(SequenceRequest(f"offline-{i}", prompt, config))
            results[f"offline-{i}"] = []
        while self.has_unfinished_requests():
            for output in self.step():
                results[output.request_id].extend(output.deltas)
        return [results[f"offline-{i}"] for i in range(len(prompts))]
