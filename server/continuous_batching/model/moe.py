"""Mixture of experts: the router and the routed experts of one MoE layer (Mixtral,
Qwen3-MoE), replacing the block's dense MLP (``moe_layers``).

Routing follows transformers (``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``): router logits
from the ``gate`` linear, softmax in float32, top-k, then (Mixtral always, Qwen3-MoE when
``norm_topk_prob``) the k weights divided by their sum. Expert weights are stacked: gate and
up fused as ``gate_up_weight`` [E, 2I, H], ``down_weight`` [E, H, I].

The experts run grouped (``SparseMoe.forward``): the step's (token, expert) pairs are sorted
by expert, each expert runs its gate_up matmul, SiLU-and-mul and down matmul once over its
rows, and the weighted rows are added back per token with one ``index_add_``. Slicing the
sorted rows per expert needs the per-expert counts on the host: one synchronisation per MoE
layer, free on a CPU. On CUDA during graph capture (where a host sync cannot happen) every
expert runs over every token instead, weighted by a dense [T, E] routing matrix (E/k times
the work; vLLM's fused_moe Triton kernel avoids both and is not ported here).
``moe_reference`` is the plain dense computation the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from .architecture import ModelArchConfig
from .decoder_layer import param
from .decoder_ops import TorchDecoderOps
from .linear import Linear, Packing


@dataclass
class Routing:
    """The experts each token goes to and their weights."""

    #: [T, k] float32 routing weights.
    weights: torch.Tensor
    #: [T, k] expert indices (int64).
    experts: torch.Tensor


def route(router_logits: torch.Tensor, top_k: int, is_norm_topk_prob: bool) -> Routing:
    """Softmax (float32) over the experts, the ``top_k`` best, renormalised to sum to 1 when
    ``is_norm_topk_prob`` (transformers' order of operations)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if is_norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights=weights, experts=experts)


def moe_reference(
    h: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    top_k: int,
    is_norm_topk_prob: bool,
) -> torch.Tensor:
    """The MoE output [T, H] in float32 by plain torch: every expert over every token,
    weighted by the dense routing matrix (zero for experts a token is not routed to)."""
    routing = route(F.linear(h, gate_weight), top_k, is_norm_topk_prob)
    num_experts, inter = gate_up_weight.shape[0], gate_up_weight.shape[1] // 2
    dense = torch.zeros(h.shape[0], num_experts).scatter_(1, routing.experts, routing.weights)
    out = torch.zeros(h.shape[0], down_weight.shape[1])
    for e in range(num_experts):
        gate_up = F.linear(h, gate_up_weight[e])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out += F.linear(act, down_weight[e]).float() * dense[:, e : e + 1]
    return out


class SparseMoe(nn.Module):
    """The router and the experts of one MoE layer (see the module docstring)."""

    def __init__(self, config: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        num_experts, hidden = config.num_experts, config.hidden_size
        inter = config.moe_intermediate_size
        self.num_experts = num_experts
        self.inter = inter
        self.top_k = config.num_experts_per_tok
        self.is_norm_topk_prob = config.is_norm_topk_prob
        self.gate_weight = param((num_experts, hidden), dtype, device)
        self.gate_up_weight = param((num_experts, 2 * inter, hidden), dtype, device)
        self.down_weight = param((num_experts, hidden, inter), dtype, device)
        self.finalize("none")

    def finalize(self, packing: Packing, kernels: ModuleType | None = None) -> None:
        """Build the router's and each expert's matmuls (``Linear``, packed as ``packing``
        says: per expert, so a bf16 CPU model runs its experts on the kernels' matmul).
        Prepacking releases the plain stacked weights, as the dense layers do."""
        if self.gate_up_weight.numel() == 0:
            raise RuntimeError("finalize() after prepacking: the plain weights are gone")
        self.router = Linear(self.gate_weight, None, packing, kernels)
        self.gate_up = [Linear(w, None, packing, kernels) for w in self.gate_up_weight]
        self.down = [Linear(w, None, packing, kernels) for w in self.down_weight]
        if packing != "none":
            for weight in (self.gate_weight, self.gate_up_weight, self.down_weight):
                weight.data = weight.data.new_empty(0)

    def hf_weight_targets(self, prefix: str) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Per-expert HF names under ``prefix`` (e.g. "mlp.") -> (target, row range):
        ``gate.weight`` and ``experts.E.{gate,up,down}_proj.weight`` (``moe_weights`` brings
        Mixtral's names and stacked layouts to these)."""
        inter, hidden = self.inter, self.gate_up_weight.shape[2]
        targets = {f"{prefix}gate.weight": (self.gate_weight, 0, self.num_experts)}
        for e in range(self.num_experts):
            expert = f"{prefix}experts.{e}"
            targets[f"{expert}.gate_proj.weight"] = (self.gate_up_weight[e], 0, inter)
            targets[f"{expert}.up_proj.weight"] = (self.gate_up_weight[e], inter, 2 * inter)
            targets[f"{expert}.down_proj.weight"] = (self.down_weight[e], 0, hidden)
        return targets

    def forward(self, h: torch.Tensor, ops: TorchDecoderOps) -> torch.Tensor:
        """The MoE output of the normed stream ``h`` [T, H], in float32."""
        routing = route(self.router(h), self.top_k, self.is_norm_topk_prob)
        if h.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._dense(h, routing, ops)
        return self._grouped(h, routing, ops)

    def _expert(self, e: int, rows: torch.Tensor, ops: TorchDecoderOps) -> torch.Tensor:
        return self.down[e](ops.silu_and_mul(self.gate_up[e](rows)))

    def _grouped(self, h: torch.Tensor, routing: Routing, ops: TorchDecoderOps) -> torch.Tensor:
        """Each expert once over the rows routed to it (sorted by expert)."""
        num_tokens, top_k = routing.experts.shape
        flat = routing.experts.flatten()
        # Stable: within an expert the rows stay in token order.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the host sync
        token_of = order // top_k
        rows = h.index_select(0, token_of)
        outs, start = [], 0
        for e, count in enumerate(counts):
            if count:
                outs.append(self._expert(e, rows[start : start + count], ops))
                start += count
        weighted = torch.cat(outs).float().mul_(routing.weights.flatten()[order].unsqueeze(1))
        out = torch.zeros(num_tokens, h.shape[1], dtype=torch.float32, device=h.device)
        # Per token, its experts' rows are added in ascending expert order, as transformers.
        return out.index_add_(0, token_of, weighted)

    def _dense(self, h: torch.Tensor, routing: Routing, ops: TorchDecoderOps) -> torch.Tensor:
        """Every expert over every token, weighted (no host sync: CUDA graph capture)."""
        dense = torch.zeros(h.shape[0], self.num_experts, device=h.device)
        dense.scatter_(1, routing.experts, routing.weights)
        out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        for e in range(self.num_experts):
            out.add_(self._expert(e, h, ops).float() * dense[:, e : e + 1])
        return out
