"""The only part of the engine that touches tensors: the model, its KV cache (pools and block
copies: ``kv_cache``), and one forward per step over every scheduled token.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import torch

from server.continuous_batching.engine_config import BatcherConfig, CacheConfig, EngineConfig
from server.continuous_batching.model.attention import plan_attention
from server.continuous_batching.model.llama import kv_bytes_per_block
from server.continuous_batching.model.paged_attention import LayerCache
from server.continuous_batching.model.weights import load_model
from server.continuous_batching.runner.cuda_graphs import DecodeGraphs
from server.continuous_batching.runner.decode_buckets import (
    DecodeInputs,
    bucket_for,
    decode_buckets,
    pad_decode_inputs,
)
from server.continuous_batching.runner.kv_cache import KVCache
from server.continuous_batching.runner.kv_memory import (
    available_memory,
    cpu_kv_budget,
    measure_cuda_memory,
    num_blocks_from_memory,
    warmup_steps,
)
from server.continuous_batching.sampling.prompt_scoring import (
    PromptRows,
    PromptScores,
    prompt_rows_of,
    score_prompt_rows,
)
from server.continuous_batching.scheduling.block_manager import BlockOps
from server.continuous_batching.scheduling.scheduler import SchedulerOutput
from server.continuous_batching.step_upload import StepUploader

logger = logging.getLogger(__name__)

_GIB = 1024**3


def resolve_max_model_len(limit: int, requested: int | None) -> int:
    """The context length: the config's ``model_max_length`` or the checkpoint's ``limit``."""
    if requested is None:
        return limit
    if requested > limit:
        logger.warning("model_max_length %d is beyond the model's %d positions", requested, limit)
    return requested


class ModelRunner:
    """Loads the model, owns the KV cache (device and CPU pools) and runs steps."""

    def __init__(self, config: EngineConfig) -> None:
        loading = config.model_loading_config
        cache = config.cache_config
        if loading.num_threads:
            torch.set_num_threads(loading.num_threads)
        #: The ``model_loading_config`` the model was loaded from.
        self.loading_config = loading
        self.model, self.arch = load_model(loading)
        self.device = self.model.device
        self.dtype = self.model.dtype
        self.max_model_len = resolve_max_model_len(
            self.arch.max_position_embeddings, loading.model_max_length
        )
        self.block_size = cache.block_size
        #: The prompt logprobs of the last :meth:`execute` (see ``prompt_scoring``).
        self.prompt_scores: list[PromptScores] = []
        #: "triton" / "cpu": decode-only steps use a paged-attention kernel; "torch": never.
        self.attention_backend = self.model.attention_backend
        #: Puts an eager step's arrays on the device (one copy from pinned memory on cuda).
        self.uploader = StepUploader(self.device)
        # Sized before CUDA graph capture: the graphs address the pool that exists then.
        self.kv_cache = self._new_kv_cache(self._num_device_blocks(config), cache.num_blocks_cpu)
        logger.info(
            "KV cache: %d device blocks + %d CPU blocks of %d tokens (%.1f MiB per block set)",
            self.num_blocks,
            self.num_blocks_cpu,
            self.block_size,
            self.kv_cache.bytes_per_block / 2**20,
        )
        #: Batch sizes a decode-only step is padded to (the CUDA graphs' shapes).
        self.decode_buckets = decode_buckets(config.batcher_config.batch_max_beams)
        self.decode_graphs: DecodeGraphs | None = None
        if self.attention_backend == "triton" and not loading.enforce_eager:
            self.decode_graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                self.decode_buckets,
                self.block_size,
                self.max_model_len,
                self.dummy_block,
            )
            self.decode_graphs.capture()
        #: Pad decode-only steps to a bucket: on with CUDA graphs; the CPU tests turn it on to
        #: check that padding changes no token (on a CPU it would only add work).
        self.is_padding_decodes = self.decode_graphs is not None
        logger.info(
            "decode attention: %s; decoder ops: %s; decode steps: %s",
            self.attention_backend,
            self.model.decoder_ops.name,
            "CUDA graphs" if self.decode_graphs is not None else "eager",
        )
        #: What computes the forward, for the log, /health and /metrics.
        self.compute_path = self.model.compute_path()
        if self.device.type == "cpu":
            logger.info("CPU path: %s", self.compute_path.summary)

    # -- the KV cache ----------------------------------------------------------------------
    @property
    def kv_caches(self) -> list[LayerCache]:
        """The device pool's (K, V) tensors per layer (dummy block included)."""
        return self.kv_cache.kv_caches

    @property
    def cpu_kv_caches(self) -> list[LayerCache]:
        """The CPU swap pool's (K, V) tensors per layer."""
        return self.kv_cache.cpu_kv_caches

    @property
    def num_blocks(self) -> int:
        """Device blocks the block manager may hand out."""
        return self.kv_cache.num_blocks

    @property
    def num_blocks_cpu(self) -> int:
        """CPU blocks for swapping."""
        return self.kv_cache.num_blocks_cpu

    @property
    def dummy_block(self) -> int:
        """One block past the pool, never handed out: padded decode rows write there."""
        return self.kv_cache.dummy_block

    def apply_block_ops(
        self, ops: BlockOps, step_block_tables: Sequence[Sequence[int]] = ()
    ) -> None:
        """The step's block copies, before its forward (see ``KVCache.apply_block_ops``)."""
        self.kv_cache.apply_block_ops(ops, step_block_tables)

    def _new_kv_cache(self, num_blocks: int, num_blocks_cpu: int) -> KVCache:
        return KVCache(
            self.arch, num_blocks, num_blocks_cpu, self.block_size, self.dtype, self.device
        )

    def _num_device_blocks(self, config: EngineConfig) -> int:
        """``num_blocks``, else from the memory left after a warm-up (cuda) or the budget."""
        cache = config.cache_config
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type == "cuda":
            return self._num_blocks_after_warmup(cache, config.batcher_config)
        bytes_per_block = kv_bytes_per_block(self.arch, self.block_size, self.dtype)
        asked = int(cache.memory_budget_gb * _GIB)
        budget = cpu_kv_budget(asked, available_memory(), bytes_per_block)
        if budget.is_capped:
            logger.warning(budget.describe())
        return max(1, budget.num_bytes // bytes_per_block)

    def _num_blocks_after_warmup(self, cache: CacheConfig, batcher: BatcherConfig) -> int:
        """Run the largest step on a temporary pool just big enough, then give the real pool
        what ``gpu_memory_utilization`` of the GPU leaves beside the peak seen (``kv_memory``).
        Only ``measure_cuda_memory`` and ``empty_cache`` need cuda."""
        max_seq_len = min(self.max_model_len, self.arch.max_position_embeddings)
        steps = warmup_steps(
            batcher.batch_max_tokens, batcher.batch_max_beams, max_seq_len, self.block_size
        )
        num_warmup_blocks = max(sum(map(len, tables)) for _, tables in steps)
        self.kv_cache = self._new_kv_cache(num_warmup_blocks, num_blocks_cpu=0)

        def run_warmup() -> None:
            for query_lens, block_tables in steps:
                self._warmup_forward(query_lens, block_tables)

        figures = measure_cuda_memory(run_warmup, self.kv_cache.device_bytes, self.device)
        bytes_per_block = self.kv_cache.bytes_per_block
        del self.kv_cache
        torch.cuda.empty_cache()  # the warm-up pool and activations go back before the real pool
        num_blocks = num_blocks_from_memory(
            figures.total, figures.peak_in_use, cache.gpu_memory_utilization, bytes_per_block
        )
        logger.info(
            "KV pool: %d blocks from gpu_memory_utilization %.2f of %s; warm-up steps of %s "
            "sequences",
            num_blocks,
            cache.gpu_memory_utilization,
            figures.describe(),
            [len(query_lens) for query_lens, _ in steps],
        )
        return num_blocks

    @torch.inference_mode()
    def _warmup_forward(self, query_lens: list[int], block_tables: list[list[int]]) -> None:
        """A prefill step from position 0 (token id 0), logits included, on the pool held now."""
        positions = [p for n in query_lens for p in range(n)]
        last_rows = [end - 1 for end in accumulate(query_lens)]
        hidden, rows = self._forward(
            [0] * len(positions), positions, query_lens, query_lens, block_tables, last_rows
        )
        self.model.compute_logits(hidden[rows])

    # -- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> torch.Tensor:
        """Run the step's forward; logits ``[num_sampling_seqs, vocab]`` float32, plan order.

        The prompt logprobs of the step's chunks that score their prompt are left in
        :attr:`prompt_scores` (empty when none asked).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        prompt_rows: list[PromptRows] = []
        self.prompt_scores = []
        for item in plan.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            end = start + item.num_query_tokens
            if item.group.is_scoring_prompt:
                rows = prompt_rows_of(
                    item.group, seq.token_ids, seq.num_prompt_tokens, (start, end), len(input_ids)
                )
                if rows is not None:
                    prompt_rows.append(rows)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(item.num_query_tokens)
            context_lens.append(end)
            block_tables.append(seq.block_table)
            if item.is_sampling:
                sample_rows.append(len(input_ids) - 1)
        self.apply_block_ops(plan.block_ops, block_tables)
        num_seqs = len(plan.scheduled)
        bucket = None
        if self.is_padding_decodes and len(input_ids) == num_seqs and not prompt_rows:
            bucket = bucket_for(num_seqs, self.decode_buckets)
        if bucket is not None:
            decode = DecodeInputs(input_ids, positions, context_lens, block_tables)
            hidden = self._decode_padded(pad_decode_inputs(decode, bucket, self.dummy_block))
            if sample_rows == list(range(num_seqs)):  # all decodes: no index to upload
                return self.model.compute_logits(hidden[:num_seqs])
            (rows,) = self.uploader.upload([np.asarray(sample_rows, dtype=np.int64)])
            return self.model.compute_logits(hidden[rows])
        hidden, rows = self._forward(
            input_ids, positions, query_lens, context_lens, block_tables, sample_rows
        )
        self.prompt_scores = score_prompt_rows(hidden, prompt_rows, self.model.compute_logits)
        if not sample_rows:
            return hidden.new_empty((0, self.arch.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[rows])

    def _forward(
        self,
        input_ids: list[int],
        positions: list[int],
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        sample_rows: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One eager forward over the flat token axis: hidden states [num_tokens, hidden],
        and ``sample_rows`` as a device tensor (uploaded with the step's other arrays)."""
        attention = plan_attention(
            query_lens,
            context_lens,
            block_tables,
            self.block_size,
            with_decode_tables=self.attention_backend != "torch",
            kernel_takes_prefill=self.attention_backend == "cpu",
        )
        ids, pos, rows, *metadata = self.uploader.upload(
            [
                np.asarray(input_ids, dtype=np.int64),
                np.asarray(positions, dtype=np.int64),
                np.asarray(sample_rows, dtype=np.int64),
                *attention.arrays(),
            ]
        )
        hidden = self.model(
            ids, pos, self.kv_caches, attention.to_metadata(metadata), block_size=self.block_size
        )
        return hidden, rows

    def _decode_padded(self, padded: DecodeInputs) -> torch.Tensor:
        """A decode step padded to its bucket: a graph replay on CUDA, else the same padded
        rows eagerly. Returns hidden states for all padded rows (the real ones come first)."""
        if self.decode_graphs is not None:
            return self.decode_graphs.run(padded)
        hidden, _ = self._forward(
            padded.input_ids,
            padded.positions,
            [1] * padded.num_seqs,
            padded.context_lens,
            padded.block_tables,
            [],
        )
        return hidden
