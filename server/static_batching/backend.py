"""``StaticBatchingBackend``: the packaging batcher and the transformers worker, as one backend."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers import GenerationConfig as HFGenerationConfig
from transformers.utils import logging as hf_logging

from protocol.health import LoadReport, ServerKind
from server.common.backend import GenerationBackend, SequenceRequest, TextDelta
from server.common.compute_thread import ComputeThread
from server.common.config import check_model_folder
from server.static_batching.batcher import PackageRecord, PackagingBatcher
from server.static_batching.config import SBServerConfig, SBWorkerConfig
from server.static_batching.worker import LoadedModel, SBWorker
from utils.config import ConfigError
from utils.errors import APIError

logger = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 2048


def load_model(config: SBWorkerConfig, config_file: str) -> LoadedModel:
    """Load model and tokenizer from local files; raises ``ConfigError`` naming the key."""
    where = f"{config_file}: worker_config"
    if config.is_gptq_quantized:
        raise ConfigError(
            f"{where}.is_gptq_quantized: GPTQ models are not supported by the static-batching "
            "server yet; serve an unquantized model here or use the continuous-batching server"
        )
    model_path = config.resolved_model_path(config_file)
    tokenizer_path = config.resolved_tokenizer_path(config_file)
    check_model_folder(config_file, "worker_config.model_name_or_path", model_path)
    check_model_folder(
        config_file, "worker_config.tokenizer_name_or_path", tokenizer_path, marker=None
    )
    try:
        device = torch.device(config.device)
    except RuntimeError as exc:
        raise ConfigError(f"{where}.device: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{where}.device: '{config.device}' but no CUDA device is available")
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    dtype = (
        config.torch_dtype if config.torch_dtype == "auto" else getattr(torch, config.torch_dtype)
    )
    hf_logging.disable_progress_bar()  # a progress bar per start-up only clutters server logs
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_path,
            revision=config.revision,
            use_fast=config.use_fast_tokenizer,
            trust_remote_code=config.trust_remote_code,
            local_files_only=True,
        )
        model = AutoModelForCausalLM.from_pretrained(
            model_path,
            revision=config.revision,
            dtype=dtype,
            low_cpu_mem_usage=config.low_cpu_mem_usage,
            use_safetensors=config.use_safetensors,
            trust_remote_code=config.trust_remote_code,
            local_files_only=True,
        )
    except (OSError, ValueError, ImportError, KeyError, RuntimeError) as exc:
        raise ConfigError(f"{where}: cannot load '{model_path}': {exc}") from None
    model.to(device).eval()

    eos_ids = _as_ids(tokenizer.eos_token_id) + _as_ids(model.generation_config.eos_token_id)
    eos_token_ids = sorted(set(eos_ids))
    pad = tokenizer.pad_token_id
    pad_token_id = pad if pad is not None else (eos_token_ids[0] if eos_token_ids else 0)
    # Requests carry every decoding setting; a checkpoint's generation_config.json must not
    # leak defaults (sampling, EOS) into them.
    model.generation_config = HFGenerationConfig(
        pad_token_id=pad_token_id, bos_token_id=model.generation_config.bos_token_id
    )
    max_model_len = (
        config.model_max_length
        or getattr(model.config, "max_position_embeddings", None)
        or _DEFAULT_MAX_MODEL_LEN
    )
    model_id = config.served_model_name or Path(model_path).resolve().name
    logger.info("loaded %s (%s, %s) from %s", model_id, dtype, device, model_path)
    return LoadedModel(
        model, tokenizer, device, model_id, max_model_len, eos_token_ids, pad_token_id
    )


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class StaticBatchingBackend(GenerationBackend):
    """Static batching over transformers ``generate``; built from a validated ``SBServerConfig``.

    The model loads in the constructor, so a bad model path fails app start-up at once;
    ``loaded`` passes an already loaded model instead (tests and benchmarks share one).
    """

    kind: ServerKind = "static_batching"

    def __init__(self, config: SBServerConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        # The model loads in the thread that will run it: one OpenMP team (compute_thread).
        self.compute = ComputeThread("sb-worker")
        self.loaded = loaded or self.compute.call(
            load_model, config.worker_config, config.config_file
        )
        self.model_id = self.loaded.model_id
        self.max_model_len = self.loaded.max_model_len
        self.tokenizer = self.loaded.tokenizer
        self.worker = SBWorker(self.loaded)
        batch_size = config.worker_config.batch_size
        self.batcher = PackagingBatcher(
            config.batcher_config,
            self.worker.run_package,
            max_prompts_per_package=batch_size if batch_size > 0 else None,
            compute=self.compute,
        )

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids of the tokenizer and of the checkpoint's generation config."""
        return list(self.loaded.eos_token_ids)

    @property
    def package_records(self) -> list[PackageRecord]:
        """The most recent packages run (id, request ids, beams, packing key), oldest first."""
        return list(self.batcher.records)

    async def start(self) -> None:
        """Start the packaging loop and the worker thread."""
        await self.batcher.start()

    async def shutdown(self) -> None:
        """Stop; running and waiting requests end with finish_reason ``abort``."""
        await self.batcher.stop()

    async def stream(self, request: SequenceRequest) -> AsyncIterator[list[TextDelta]]:
        """Yield delta batches until every choice finished; closing early aborts the request.

        A request with ``resumed_token_ids`` (``protocol.resume``) continues its choice from
        those tokens as its own output (see :mod:`server.static_batching.rows`): greedy
        gives the undisturbed run's continuation. Seeded sampling does not reproduce the first
        server's draws (``generate`` draws from one generator seeded per call, not per choice
        and position as the continuous-batching engine does): the resumed text differs there.
        """
        self._check(request)
        state = self.batcher.submit(request)
        num_open = state.num_choices
        try:
            while num_open > 0:
                item = await state.queue.get()
                if isinstance(item, APIError):
                    num_open = 0
                    raise item
                num_open -= sum(1 for delta in item if delta.finish_reason is not None)
                state.is_finished = num_open == 0
                yield item
        finally:
            if num_open > 0:  # closed early (client gone, timeout, cancellation)
                self.batcher.abort(state)

    def _check(self, request: SequenceRequest) -> None:
        # The HTTP layer checks lengths first; this guards direct users of the backend.
        if not request.prompt_token_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        max_new_tokens = request.config.max_new_tokens
        if max_new_tokens is None:
            raise APIError(400, "max_new_tokens must be set", param="max_new_tokens")
        if request.resumed_token_ids:
            if request.config.is_beam_search:  # the service refuses it first
                raise APIError(400, "a beam search cannot be resumed", param="resume")
            if len(request.resumed_token_ids) >= max_new_tokens:  # as the CB engine says it
                raise APIError(400, "the resumed choice has no token left to generate")
        # The resumed tokens are part of max_new_tokens: the prompt's figure covers them.
        if request.num_prompt_tokens + max_new_tokens > self.max_model_len:
            raise APIError(
                400,
                f"prompt ({request.num_prompt_tokens} tokens) plus max_new_tokens "
                f"({max_new_tokens}) exceeds the model's context of {self.max_model_len} tokens",
                param="max_new_tokens",
            )

    def load_report(self) -> LoadReport:
        """Waiting and running requests."""
        return LoadReport(
            num_waiting=self.batcher.num_waiting, num_running=self.batcher.num_running
        )
