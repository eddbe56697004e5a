"""OpenAI's sampling knobs written out from their definitions, one row at a time in plain
torch: the reference the servers' batched ops are tested against (``logit_bias``,
``presence_penalty``, ``frequency_penalty``, ``min_p``), and a transformers logits processor
built from them, so that ``generate`` gives the reference tokens."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


def f32(value: float) -> torch.Tensor:
    """``value`` rounded to float32, as the servers hold every knob."""
    return torch.tensor(value, dtype=torch.float32)


def ref_logit_bias(row: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """OpenAI / vLLM: ``logits[t] += bias[t]``."""
    out = row.clone()
    for token, value in bias.items():
        out[token] = out[token] + f32(value)
    return out


def ref_additive_penalties(
    row: torch.Tensor, output: list[int], frequency: float, presence: float
) -> torch.Tensor:
    """OpenAI / vLLM: ``logits[t] -= frequency * count(t) + presence * (count(t) > 0)`` over
    the generated tokens only (vLLM subtracts the two terms one after the other)."""
    out = row.clone()
    for token in set(output):
        out[token] = out[token] - f32(frequency) * output.count(token)
        out[token] = out[token] - f32(presence)
    return out


def ref_min_p(row: torch.Tensor, min_p: float) -> torch.Tensor:
    """vLLM: drop tokens whose probability is below ``min_p`` times the top probability."""
    probs = torch.softmax(row, dim=-1)
    keep = probs >= f32(min_p) * probs.max()
    return torch.where(keep, row, torch.full_like(row, -float("inf")))


class ReferenceKnobs(LogitsProcessor):
    """``logit_bias`` then the presence and frequency penalties (vLLM's order) for one
    prompt's ``generate``; the generated tokens are those past ``num_prompt_tokens``."""

    def __init__(
        self,
        num_prompt_tokens: int,
        logit_bias: dict[int, float] | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
    ) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.logit_bias = logit_bias or {}
        self.frequency_penalty = frequency_penalty
        self.presence_penalty = presence_penalty

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        rows = []
        for ids, row in zip(input_ids.tolist(), scores, strict=True):
            row = ref_logit_bias(row, self.logit_bias)
            output = ids[self.num_prompt_tokens :]
            rows.append(
                ref_additive_penalties(row, output, self.frequency_penalty, self.presence_penalty)
            )
        return torch.stack(rows)


def reference_greedy(
    hf_model: object, prompt: list[int], max_new_tokens: int, **knobs: object
) -> list[int]:
    """transformers' greedy tokens for ``prompt`` with :class:`ReferenceKnobs` (``knobs``:
    ``logit_bias``, ``frequency_penalty``, ``presence_penalty``), EOS ignored."""
    inputs = torch.tensor([prompt])
    processor = ReferenceKnobs(len(prompt), **knobs)  # type: ignore[arg-type]
    with torch.inference_mode():
        out = hf_model.generate(  # type: ignore[attr-defined]
            inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            logits_processor=[processor],
        )
    return out[0, len(prompt) :].tolist()
