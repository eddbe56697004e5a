"""Load a llama-family Hugging Face checkpoint into the continuous-batching model.

Loading is split in two so other checkpoint formats can plug in later:

* a *source* yields ``(hf_name, tensor)`` pairs in Hugging Face naming
  (``iter_safetensors`` here; GGUF and GPTQ sources can yield dequantised tensors under the
  same names);
* ``assign_weights`` copies those pairs into the model's (partly fused) parameters, casting
  to the model dtype, and checks that every parameter was filled exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .model.config import ModelArchConfig
from .model.llama import LlamaForCausalLM

#: Tensors some checkpoints carry that the model recomputes itself.
_IGNORED_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)


class WeightLoadError(RuntimeError):
    """The checkpoint's tensors do not match the model built from its config."""


def read_arch_config(model_path: str | Path) -> ModelArchConfig:
    """Parse ``config.json`` of a Hugging Face model folder."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in model folder {model_path}")
    return ModelArchConfig.from_hf_config(json.loads(config_file.read_text()))


def safetensors_files(model_path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards listed by the index file if present,
    else every ``*.safetensors`` in the folder."""
    folder = Path(model_path)
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model folder {model_path}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"safetensors shards listed but missing: {missing}")
    return files


def iter_safetensors(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for every tensor of a (possibly sharded) safetensors folder.
    Tensors are read lazily one at a time, so peak memory stays near one tensor above the
    model itself."""
    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                yield name, f.get_tensor(name)


def assign_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model's parameters (fused ones by row range).

    Raises WeightLoadError naming unexpected, duplicate, mis-shaped or missing tensors.
    A stored ``lm_head.weight`` is skipped when the embeddings are tied (some tied
    checkpoints keep a copy).
    """
    targets = model.hf_weight_targets()
    tied = model.config.tie_word_embeddings
    seen: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in tensors:
            if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                continue
            target = targets.get(name)
            if target is None:
                unexpected.append(name)
                continue
            if name in seen:
                raise WeightLoadError(f"tensor {name!r} appears twice in the checkpoint")
            param, start, end = target
            expected = (end - start, *param.shape[1:])
            if tuple(tensor.shape) != expected:
                raise WeightLoadError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                )
            param[start:end].copy_(tensor)
            seen.add(name)
    missing = sorted(set(targets) - seen)
    if unexpected or missing:
        raise WeightLoadError(
            f"checkpoint does not match the model: missing {_preview(missing)}, "
            f"unexpected {_preview(unexpected)}"
        )


def _preview(names: list[str], limit: int = 8) -> str:
    """Short list of names for an error message."""
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return f"{names[:limit]}{more}" if names else "none"


def load_model(
    model_path: str, dtype: torch.dtype, device: torch.device
) -> tuple[LlamaForCausalLM, ModelArchConfig]:
    """Build the model from ``config.json`` and fill it from the folder's safetensors.
    Raises UnsupportedModelError (non-llama architecture) or WeightLoadError."""
    config = read_arch_config(model_path)
    model = LlamaForCausalLM(config, dtype=dtype, device=torch.device(device))
    assign_weights(model, iter_safetensors(model_path))
    model.eval()
    return model, config
