"""GPU-ONLY: decode-only steps replayed from CUDA graphs captured at start-up, one per bucket.

A batch-32 decode step of a 1B llama spent ~8.5 ms on the host launching ~490 small kernels
for ~3 ms of GPU work; a graph replay launches them all at once. Each graph reads its inputs
from static buffers (token ids, positions, slots, block tables, context lengths), which the
runner fills before ``replay()``; the KV caches are addressed through those buffers, so one
graph serves every step of its bucket. Graphs need the Triton paged-attention kernels (the
torch path builds per-step tensors of varying shapes), so they are used only on CUDA with
triton, and never with ``enforce_eager``. Mixed prefill/decode steps always run eagerly.

Nothing here runs on a CPU; the padding it relies on (``decode_buckets``) is plain code that
the CPU tests run eagerly.
"""

from __future__ import annotations

import logging

import torch

from server.continuous_batching.model.attention import AttentionMetadata, DecodeTables
from server.continuous_batching.model.llama import LlamaForCausalLM
from server.continuous_batching.model.paged_attention import LayerCache
from server.continuous_batching.runner.decode_buckets import DecodeInputs, pad_decode_inputs
from server.continuous_batching.step_upload import StaticDecodeBuffers

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """One captured decode forward per bucket over shared static input buffers."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[LayerCache],
        buckets: list[int],
        block_size: int,
        max_model_len: int,
        dummy_block: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = sorted(buckets)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.dummy_block = dummy_block
        self.max_blocks = -(-max_model_len // block_size)
        #: The graphs' inputs: views of one device buffer, filled by one copy per step.
        self.inputs = StaticDecodeBuffers(
            self.buckets[-1], self.max_blocks, block_size, dummy_block, model.device
        )
        self.input_ids = self.inputs.input_ids
        self.positions = self.inputs.positions
        self.slot_mapping = self.inputs.slot_mapping
        self.block_tables = self.inputs.block_tables
        self.context_lens = self.inputs.context_lens
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata viewing the first ``size`` rows of the static buffers. The kernel grid is
        sized for ``max_model_len`` so any context of the bucket fits the captured launch."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            groups=[],
            num_tokens=size,
            decode=DecodeTables(
                block_tables=self.block_tables[:size],
                context_lens=self.context_lens[:size],
                max_context_len=self.max_model_len,
            ),
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_caches,
            self._metadata(size),
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool)."""
        empty = DecodeInputs([], [], [], [])
        self._fill(pad_decode_inputs(empty, self.buckets[-1], self.dummy_block))
        pool = None
        for size in reversed(self.buckets):
            self._forward(size)  # warm-up: compiles the Triton kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("CUDA graphs captured for decode batch sizes %s", self.buckets)

    def _fill(self, inputs: DecodeInputs) -> None:
        """Copy a (padded) step into the static buffers (one host-to-device copy)."""
        self.inputs.fill(
            inputs.input_ids, inputs.positions, inputs.context_lens, inputs.block_tables
        )

    def run(self, padded: DecodeInputs) -> torch.Tensor:
        """Replay the graph of ``padded``'s bucket; hidden states [bucket, hidden] (a view of
        the graph's output buffer: valid until the next replay)."""
        self._fill(padded)
        self.graphs[padded.num_seqs].replay()
        return self.outputs[padded.num_seqs]
