"""The only part of the engine that touches tensors: the model, its KV-cache pools, the block
copies the scheduler asks for, and one forward per step over every scheduled token.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from server.continuous_batching.block_manager import BlockOps
from server.continuous_batching.cuda_graphs import DecodeGraphs
from server.continuous_batching.decode_buckets import (
    DecodeInputs,
    bucket_for,
    decode_buckets,
    pad_decode_inputs,
)
from server.continuous_batching.engine_config import EngineConfig
from server.continuous_batching.model.attention import plan_attention
from server.continuous_batching.model.llama import kv_bytes_per_block, kv_cache_shape
from server.continuous_batching.scheduler import SchedulerOutput
from server.continuous_batching.step_upload import StepUploader
from server.continuous_batching.weights import load_model

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
    """Loads the model, owns the device and CPU KV pools and runs steps."""

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
        bytes_per_block = kv_bytes_per_block(self.arch, self.block_size, self.dtype)
        self.num_blocks = cache.num_blocks or max(
            1, int(cache.memory_budget_gb * _GIB) // bytes_per_block
        )
        self.num_blocks_cpu = cache.num_blocks_cpu
        #: One block past the pool, never handed out: padded decode rows write there.
        self.dummy_block = self.num_blocks
        self.kv_caches = self._allocate(self.num_blocks + 1, self.device)
        self.cpu_kv_caches = self._allocate(cache.num_blocks_cpu, torch.device("cpu"))
        self._block_offsets = torch.arange(self.block_size, device=self.device)
        #: Puts an eager step's arrays on the device (one copy from pinned memory on cuda).
        self.uploader = StepUploader(self.device)
        logger.info(
            "KV cache: %d device blocks + %d CPU blocks of %d tokens (%.1f MiB per block set)",
            self.num_blocks,
            cache.num_blocks_cpu,
            self.block_size,
            bytes_per_block / 2**20,
        )
        #: "triton" / "cpu": decode-only steps use a paged-attention kernel; "torch": never.
        self.attention_backend = self.model.attention_backend
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

    def _allocate(self, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
        shape = kv_cache_shape(self.arch, num_blocks, self.block_size)
        pin = device.type == "cpu" and self.device.type == "cuda"
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin),
                torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin),
            )
            for _ in range(self.arch.num_hidden_layers)
        ]

    # -- block copies ---------------------------------------------------------------------
    def _slots(self, blocks: list[int], device: torch.device) -> torch.Tensor:
        ids = torch.tensor(blocks, dtype=torch.long, device=device)
        offsets = self._block_offsets.to(device)
        return (ids[:, None] * self.block_size + offsets[None, :]).reshape(-1)

    def _copy_blocks(
        self,
        pairs: list[tuple[int, int]],
        source: list[tuple[torch.Tensor, ...]],
        target: list[tuple[torch.Tensor, ...]],
    ) -> None:
        if not pairs:
            return
        src_device = source[0][0].device
        dst_device = target[0][0].device
        src = self._slots([p[0] for p in pairs], src_device)
        dst = self._slots([p[1] for p in pairs], dst_device)
        for (src_k, src_v), (dst_k, dst_v) in zip(source, target, strict=True):
            dst_k[dst] = src_k[src].to(dst_device, non_blocking=True)
            dst_v[dst] = src_v[src].to(dst_device, non_blocking=True)

    @torch.inference_mode()
    def apply_block_ops(self, ops: BlockOps) -> None:
        """Swap out, swap in, then copy-on-write, before the step's forward writes anything."""
        self._copy_blocks(list(ops.swap_out.items()), self.kv_caches, self.cpu_kv_caches)
        self._copy_blocks(list(ops.swap_in.items()), self.cpu_kv_caches, self.kv_caches)
        self._copy_blocks(ops.copy, self.kv_caches, self.kv_caches)

    # -- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> torch.Tensor:
        """Run the step's forward; logits ``[num_sampling_seqs, vocab]`` float32, plan order."""
        self.apply_block_ops(plan.block_ops)
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        for item in plan.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            end = start + item.num_query_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(item.num_query_tokens)
            context_lens.append(end)
            block_tables.append(seq.block_table)
            if item.is_sampling:
                sample_rows.append(len(input_ids) - 1)
        num_seqs = len(plan.scheduled)
        bucket = None
        if self.is_padding_decodes and len(input_ids) == num_seqs:
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
