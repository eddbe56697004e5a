"""Config readers of the model families the engine runs: a Hugging Face ``config.json`` ->
``ModelArchConfig``, one module per family. Torch-free.

``read_hf_config`` picks the reader by the config's ``architectures[0]``; a family that needs
its own decoder block also sets ``ModelArchConfig.family`` (see ``layer_classes``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..architecture import ModelArchConfig, UnsupportedModelError
from . import gemma, llama, mixtral, phi3, qwen3, qwen3_moe

ConfigReader = Callable[[dict[str, Any]], ModelArchConfig]

#: Hugging Face architecture name -> its config reader.
CONFIG_READERS: dict[str, ConfigReader] = {
    **dict.fromkeys(llama.ARCHITECTURES, llama.read_config),
    **dict.fromkeys((*gemma.ARCHITECTURES, *gemma.MULTIMODAL_ARCHITECTURES), gemma.read_config),
    **dict.fromkeys(qwen3.ARCHITECTURES, qwen3.read_config),
    **dict.fromkeys(phi3.ARCHITECTURES, phi3.read_config),
    **dict.fromkeys(mixtral.ARCHITECTURES, mixtral.read_config),
    **dict.fromkeys(qwen3_moe.ARCHITECTURES, qwen3_moe.read_config),
}

#: The architectures the engine serves, for error messages and the docs.
#: (Readers that only explain a refusal, as Gemma 3's multimodal one, are not listed.)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(
    sorted(set(CONFIG_READERS) - set(gemma.MULTIMODAL_ARCHITECTURES))
)


def read_hf_config(d: dict[str, Any]) -> ModelArchConfig:
    """Build the architecture from a parsed ``config.json``; UnsupportedModelError names the
    architecture when no family reads it."""
    architectures = d.get("architectures") or []
    arch = architectures[0] if architectures else None
    reader = CONFIG_READERS.get(arch) if isinstance(arch, str) else None
    if reader is None:
        raise UnsupportedModelError(
            f"unsupported model architecture {arch!r} (model_type {d.get('model_type')!r}): "
            f"the continuous-batching engine runs {list(SUPPORTED_ARCHITECTURES)}"
        )
    return reader(d)
