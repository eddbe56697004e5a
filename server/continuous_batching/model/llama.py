"""The decoder-only causal LM of the continuous-batching engine (llama and the families
built on its block: ``layer_classes``).

The tokens of every sequence in a step (prefill chunks and decodes alike) are flattened into
one [num_tokens] axis and go through one forward. Per layer that is: RMSNorm, one fused q/k/v
matmul, RoPE on q and k together with the cache writes, paged attention, o_proj with the
residual add fused into the matmul, RMSNorm, one fused gate/up matmul, SiLU * up, down_proj
fused with the residual add. The element-wise steps come from ``decoder_ops`` (torch, the
fused C++ kernels on a CPU, or fused Triton kernels for 16-bit weights on CUDA:
``triton_fused``). No Python loop over sequences or tokens and
no host synchronisation happen inside the forward.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from protocol.health import ComputePath

from ..quantization.packed_gguf import PackedWeight
from . import cpu_isa, triton_fused, triton_paged_attention
from .architecture import ModelArchConfig
from .attention import AttentionMetadata
from .cpu_isa import CpuPath
from .decoder_layer import LlamaDecoderLayer, param
from .decoder_ops import TorchDecoderOps, decoder_ops_for
from .layer_classes import layer_class_for
from .linear import Linear, LinearLike, choose_packing
from .paged_attention import AttentionBackend, LayerCache, PagedAttention
from .rotary import RopeRows, RotaryTables

logger = logging.getLogger(__name__)

__all__ = [
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "ModelArchConfig",
    "kv_bytes_per_block",
    "kv_cache_shape",
]


#: Per row, the 16-bit logits of this many best candidates are recomputed in float32.
NUM_REFINED_LOGITS = 8


def kv_cache_shape(config: ModelArchConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of one layer's K (or V) cache: [num_blocks * block_size, kv_heads, head_dim]."""
    return (num_blocks * block_size, config.num_key_value_heads, config.head_dim)


def kv_bytes_per_block(config: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * block_size * dtype.itemsize


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache (see the module docstring)."""

    def __init__(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype,
        device: torch.device,
        use_cpu_kernels: bool = True,
        cpu_path: CpuPath | None = None,
    ) -> None:
        """``use_cpu_kernels``: on a CPU, run the fused C++ kernels of ``cpu_path``'s ISA
        level (default: ``cpu_isa.resolve()``, the CPU's best) when they can be built."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.cpu_path = cpu_path or cpu_isa.resolve()
        self.embed_tokens = param((config.vocab_size, config.hidden_size), dtype, self.device)
        #: The embedding table kept packed instead (``replace_embedding``), or None.
        self.packed_embedding: PackedWeight | None = None
        self.layers = nn.ModuleList(
            layer_class_for(config, i)(config, dtype, self.device)
            for i in range(config.num_hidden_layers)
        )
        for i, layer in enumerate(self.layers):
            layer.attention_window = config.window_of(i)
        self.norm = param((config.hidden_size,), dtype, self.device)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = param((config.vocab_size, config.hidden_size), dtype, self.device)
        self.rotary = RotaryTables(config, dtype, self.device)
        self.residual_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
        self.lm_head_linear: LinearLike = Linear(self.lm_head, None)
        #: True once ``replace_lm_head`` installed another lm_head matmul (e.g. quantised).
        self.is_lm_head_replaced = False
        #: How the matmul weights are held, for the log and /health (the loader says).
        self.weight_format: str | None = None
        self.decoder_ops: TorchDecoderOps
        self.attention_backend: AttentionBackend
        ops = decoder_ops_for(self.device, use_cpu_kernels, self.cpu_path)
        if triton_fused.is_available(self.device, dtype):
            # 16-bit weights on CUDA: fused Triton element-wise steps (float32 keeps torch's).
            ops = triton_fused.TritonDecoderOps()
        self.set_decoder_ops(ops)

    def set_decoder_ops(self, ops: TorchDecoderOps) -> None:
        """Run the element-wise steps with ``ops`` and pick the matching attention backend:
        steps whose metadata carries DecodeTables (decode-only steps; on CPU every step) go to
        the Triton kernels on CUDA with triton installed, to the fused kernel with the fused
        CPU ops, else torch."""
        self.decoder_ops = ops
        if triton_paged_attention.is_available(self.device):
            self.attention_backend = "triton"
        else:
            self.attention_backend = ops.attention_backend

    def finalize(self) -> None:
        """Call once the weights are loaded: packs CPU matmul weights where some packing runs
        on this CPU (``linear.choose_packing``)."""
        kernels = self.decoder_ops.module
        packing = choose_packing(self.device, self.dtype, self.cpu_path, kernels)
        for layer in self.layers:
            layer.finalize(packing, kernels)
        if not self.is_lm_head_replaced:
            self.lm_head_linear = Linear(self.lm_head, None, packing, kernels)
        if self.device.type == "cpu" and self.dtype != torch.float32 and packing == "none":
            # Served all the same, by the best there is here: torch's own 16-bit matmul.
            name = str(self.dtype).removeprefix("torch.")
            logger.warning(
                "%s weights have no fast matmul on this CPU path (%s): torch's %s matmul "
                "runs, measured about 4x slower than float32 at batch 32 on an AVX2 CPU; "
                "torch_dtype float32 is faster here, at twice the memory",
                name,
                self.cpu_path.describe(name, kernels is not None),
                name,
            )

    def replace_lm_head(self, linear: LinearLike) -> None:
        """Install another lm_head matmul (a quantised one: it computes float32 logits from
        float32 hidden states, so ``compute_logits`` needs no refinement). An untied dense
        lm_head is dropped (the loader then no longer expects it); a tied one stays, as the
        embedding."""
        self.lm_head_linear = linear
        self.is_lm_head_replaced = True
        if not self.config.tie_word_embeddings:
            self.lm_head = None

    def compute_path(self) -> ComputePath:
        """The device, ISA level and ops that run this model (for the log and /health)."""
        ops = self.decoder_ops.name
        if self.device.type != "cpu":
            summary = f"decoder ops: {ops}"
            weights = self.weight_format
            return ComputePath(
                device=str(self.device), decoder_ops=ops, summary=summary, weights=weights
            )
        path = self.cpu_path
        dtype_name = str(self.dtype).removeprefix("torch.")
        summary = path.describe(dtype_name, kernels_loaded=self.decoder_ops.module is not None)
        if self.weight_format is not None:
            summary += f"; weights: {self.weight_format}"
        summary += f"; torch's own CPU kernels: {torch.backends.cpu.get_cpu_capability()}"
        return ComputePath(
            device="cpu",
            isa=path.level,
            best_isa=path.best_level,
            decoder_ops=ops,
            summary=summary,
            weights=self.weight_format,
        )

    def hf_weight_targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Map each Hugging Face tensor name to (our parameter, first row, end row): fused
        parameters receive several HF tensors, each into its own row range."""
        c = self.config
        targets: dict[str, tuple[torch.Tensor, int, int]] = {
            "model.norm.weight": (self.norm, 0, c.hidden_size),
        }
        if self.embed_tokens is not None:
            targets["model.embed_tokens.weight"] = (self.embed_tokens, 0, c.vocab_size)
        if not c.tie_word_embeddings and self.lm_head is not None:
            targets["lm_head.weight"] = (self.lm_head, 0, c.vocab_size)
        for i, layer in enumerate(self.layers):
            for suffix, (target, start, end) in layer.hf_weight_targets(c).items():
                if target is not None:
                    targets[f"model.layers.{i}.{suffix}"] = (target, start, end)
        return targets

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerCache],
        attn: AttentionMetadata,
        block_size: int = 0,
    ) -> torch.Tensor:
        """Run one step over the flat token axis; returns final-norm hidden states [T, hidden].

        ``block_size`` (the cache's) is needed only when ``attn`` carries DecodeTables."""
        c = self.config
        ropes = self.layer_ropes(positions)
        attention = PagedAttention(
            attn,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            self.dtype,
            backend=self.attention_backend,
            block_size=block_size,
            kernels=self.decoder_ops.module,
        )
        # 16-bit models keep the residual stream in float32: each layer adds its output to
        # it without rounding, which keeps bfloat16 logits about twice as close to float32.
        x = self.embed(input_ids)
        delta = None
        for layer, kv_cache, rope in zip(self.layers, kv_caches, ropes, strict=True):
            x, delta = layer(x, delta, rope, kv_cache, attention, self.decoder_ops)
        if delta is not None:
            x = x.add_(delta)
        if x.dtype == self.norm.dtype:
            return self.decoder_ops.rms_norm(x, self.norm, c.rms_norm_eps)
        # Kept in float32: compute_logits refines the best candidates from it.
        return F.rms_norm(x, (c.hidden_size,), self.norm.float(), c.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start [T, hidden]: the tokens' embeddings (a family may
        scale them: Gemma)."""
        return self.embedding_rows(input_ids).to(self.residual_dtype)

    def embedding_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embedding rows in the model dtype: gathered from the dense table, or
        dequantised row by row from a packed one (``replace_embedding``), the same values."""
        if self.packed_embedding is None:
            return F.embedding(input_ids, self.embed_tokens)
        rows = self.packed_embedding.dequantize_rows(input_ids.reshape(-1), self.decoder_ops.module)
        return rows.to(self.dtype).reshape(*input_ids.shape, -1)

    def replace_embedding(self, weight: PackedWeight) -> None:
        """Keep the embedding table packed (a quantised GGUF's ``token_embd``): each step
        dequantises only its tokens' rows. The dense table is dropped (the loader then no
        longer expects it); a tied lm_head must have been replaced already."""
        if self.config.tie_word_embeddings and not self.is_lm_head_replaced:
            raise ValueError("a tied dense lm_head needs the dense embedding table")
        self.packed_embedding = weight
        self.embed_tokens = None
        if self.config.tie_word_embeddings:
            self.lm_head = None

    def layer_ropes(self, positions: torch.Tensor) -> list[RopeRows]:
        """Each layer's RoPE rows at ``positions`` (one lookup shared by all layers here; a
        family with several rope bases picks per layer: Gemma 3)."""
        return [self.rotary.lookup(positions)] * len(self.layers)

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] in float32 for the rows the runner samples from.

        16-bit models compute them with the fast 16-bit matmul, then recompute the best
        ``NUM_REFINED_LOGITS`` candidates of each row exactly in float32: bfloat16 rounds
        logits near 25 to steps of 0.125, which turns close candidates into exact ties and
        flips greedy choices, while a float32 lm_head would read 4x the bytes every step.
        """
        if self.is_lm_head_replaced:
            # Quantised lm_head: float32 in, float32 out, at the cost of the 16-bit matmul.
            return self.lm_head_linear(hidden_states.float()).float()
        logits = self.lm_head_linear(hidden_states.to(self.dtype))
        if self.residual_dtype == self.dtype or logits.shape[0] == 0:
            return logits.float()
        return self.decoder_ops.refine_logits(
            logits, hidden_states, self.lm_head, NUM_REFINED_LOGITS
        )
