"""Expert tensors of every layout under the one naming ``SparseMoe.hf_weight_targets`` uses:
``model.layers.N.mlp.gate.weight`` and ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.
weight`` (Qwen3-MoE's Hub layout). vLLM accepts the same layouts:

* Mixtral's Hub names: ``block_sparse_moe.`` for ``mlp.``, experts' ``w1`` (gate), ``w3``
  (up), ``w2`` (down);
* transformers 5's in-memory layout (what its conversion mapping builds, and what a
  checkpoint saved without the reverse mapping holds): stacked ``mlp.experts.gate_up_proj``
  [E, 2I, H] (gate rows first) and ``mlp.experts.down_proj`` [E, H, I];
* llama.cpp's stacked ``ffn_{gate,up,down}_exps`` (``weights_gguf`` names them
  ``mlp.experts.{gate,up,down}_proj``): [E, I, H], [E, I, H] and [E, H, I].

A stacked tensor is split into per-expert views (no copy).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJECTIONS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
_STACKED = re.compile(
    r"^(.*\.mlp\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?$"
)


def canonical_name(name: str) -> str:
    """Mixtral's Hub name of an expert or router tensor -> the canonical one (others as is)."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m[1]}.{_MIXTRAL_PROJECTIONS[m[2]]}.", name)


def split_stacked(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert tensors of a stacked expert tensor (3-D, expert first); else the pair."""
    match = _STACKED.match(name)
    if match is None or tensor.dim() != 3:
        yield name, tensor
        return
    prefix, kind = match[1], match[2]
    for e, expert in enumerate(tensor.unbind(0)):
        if kind == "gate_up_proj":
            inter = expert.shape[0] // 2
            yield f"{prefix}.{e}.gate_proj.weight", expert[:inter]
            yield f"{prefix}.{e}.up_proj.weight", expert[inter:]
        else:
            yield f"{prefix}.{e}.{kind}.weight", expert


def canonical_expert_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The (hf_name, tensor) pairs with expert tensors renamed and split (see the module
    docstring); every other pair unchanged."""
    for name, tensor in tensors:
        yield from split_stacked(canonical_name(name), tensor)
