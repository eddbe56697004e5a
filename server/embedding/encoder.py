"""A Hugging Face encoder with the pooling of its sentence-transformers folder.

sentence-transformers describes a model as a pipeline in ``modules.json``: the transformer, a
``Pooling`` module (its ``config.json`` says which pooling: mean, CLS, max, mean-sqrt-len)
and, optionally, ``Normalize`` (unit length). The encoder reads that description and does the
same with plain transformers + torch, so the sentence-transformers package is not needed. A
folder without ``modules.json`` gets mean pooling and normalisation, the common choice.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

logger = logging.getLogger(__name__)

_POOLING_TYPE = "sentence_transformers.models.Pooling"
_NORMALIZE_TYPE = "sentence_transformers.models.Normalize"
#: Pooling modes of sentence-transformers' Pooling config, in the order it checks them.
_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")


@dataclass(frozen=True)
class Pooling:
    """How token vectors become one vector (from the folder's pooling config)."""

    mode: str = "mean_tokens"
    is_normalized: bool = True
    max_seq_length: int | None = None

    @classmethod
    def from_folder(cls, folder: Path) -> Pooling:
        """The pooling of a sentence-transformers folder (defaults without ``modules.json``)."""
        modules_file = folder / "modules.json"
        if not modules_file.is_file():
            logger.warning("%s has no modules.json: mean pooling, normalised", folder)
            return cls()
        modules = json.loads(modules_file.read_text())
        types = [module["type"] for module in modules]
        mode = "mean_tokens"
        for module in modules:
            if module["type"] == _POOLING_TYPE:
                config = json.loads((folder / module["path"] / "config.json").read_text())
                modes = [m for m in _MODES if config.get(f"pooling_mode_{m}")]
                if len(modes) != 1:
                    raise ValueError(f"{folder}: one pooling mode is supported, found {modes}")
                mode = modes[0]
        bert_config = folder / "sentence_bert_config.json"
        max_len = (
            json.loads(bert_config.read_text()).get("max_seq_length")
            if (bert_config.is_file())
            else None
        )
        return cls(mode=mode, is_normalized=_NORMALIZE_TYPE in types, max_seq_length=max_len)

    def apply(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One vector per row of ``hidden`` (batch, tokens, dim), padding left out."""
        mask_f = mask.unsqueeze(-1).to(hidden.dtype)
        if self.mode == "cls_token":
            pooled = hidden[:, 0]
        elif self.mode == "max_tokens":
            pooled = hidden.masked_fill(mask_f == 0, float("-inf")).max(dim=1).values
        else:
            summed = (hidden * mask_f).sum(dim=1)
            counts = mask_f.sum(dim=1).clamp(min=1e-9)
            pooled = summed / (counts.sqrt() if self.mode == "mean_sqrt_len_tokens" else counts)
        if self.is_normalized:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled


class Encoder:
    """The model, its tokenizer and its pooling; :meth:`encode` runs one padded batch."""

    def __init__(
        self, folder: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        self.folder = Path(folder)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.model = AutoModel.from_pretrained(self.folder, dtype=dtype).to(self.device).eval()
        self.pooling = Pooling.from_folder(self.folder)
        positions = getattr(self.model.config, "max_position_embeddings", 512)
        #: Most tokens (special tokens included) one input may have.
        self.max_tokens = min(self.pooling.max_seq_length or positions, positions)
        self.dimension = int(self.model.config.hidden_size)
        self.vocab_size = len(self.tokenizer)
        self._prefix, self._suffix = self._special_frame()
        self.num_special_tokens = len(self._prefix) + len(self._suffix)

    def _special_frame(self) -> tuple[list[int], list[int]]:
        """The special tokens the tokenizer puts before and after a text's own tokens (found
        by encoding a probe text with and without them)."""
        framed = self.tokenizer.encode("hello", add_special_tokens=True)
        bare = self.tokenizer.encode("hello", add_special_tokens=False)
        for start in range(len(framed) - len(bare) + 1):
            if framed[start : start + len(bare)] == bare:
                return framed[:start], framed[start + len(bare) :]
        return [], []

    def token_ids(self, text: str) -> list[int]:
        """The ids of ``text`` without special tokens (they are added by :meth:`with_specials`)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def batch_token_ids(self, texts: list[str]) -> list[list[int]]:
        """:meth:`token_ids` of many texts in one call (the fast tokenizer works in parallel)."""
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def with_specials(self, ids: list[int]) -> list[int]:
        """``ids`` framed by the model's special tokens (``[CLS] ... [SEP]`` for BERT)."""
        return [*self._prefix, *ids, *self._suffix]

    @torch.inference_mode()
    def encode(self, inputs: list[list[int]]) -> torch.Tensor:
        """The pooled float32 vectors (on the CPU) of ``inputs`` (ids with special tokens)."""
        longest = max(len(ids) for ids in inputs)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(inputs), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(inputs), longest), dtype=torch.long)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return self.pooling.apply(hidden.float(), mask).cpu()
