"""The decoding parameters of one logits row (one sequence of a request), as plain data.

The sampler (torch) reads them to process the row's logits; the decoder (plain Python) builds
them from the request's config and keeps them on the sequence. Only the seeded generator is a
torch object, and this module merely holds it as an opaque value: it imports no torch, not even
for annotations, so the decoding bookkeeping that builds rows stays free of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.generation import GenerationConfig
from server.common.bad_words import bad_word_bans

__all__ = ["RowLogprobs", "RowParams"]

#: One row's logprobs as the sampler reads them back: the chosen token's logprob (float32
#: values, -inf kept) and its likeliest ``(token id, logprob)`` pairs, best first.
RowLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass
class RowParams:
    """Decoding parameters of one batch row (one sequence of a request)."""

    is_greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    # OpenAI's additive knobs (see server.common.logit_knobs for definitions and order).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # 0 disables min-p
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's allowed_token_ids: every other token scores -inf (None: all allowed).
    allowed_token_ids: list[int] | None = None
    generator: Any = None  # a torch.Generator; None draws from the global RNG
    # A seeded row's draw seeds a generator afresh with this key (draw_keys.draw_key of the
    # seed, the choice and the position); set per step by the decoder, it wins over generator.
    draw_key: int | None = None
    # Ids scored -inf this step, e.g. EOS + stop ids while min_new_tokens is not reached.
    banned_token_ids: list[int] = field(default_factory=list)
    # Prompt + generated ids. HF's repetition penalty covers them all (input_ids holds the
    # prompt); the presence and frequency penalties and the bad words only the generated ones,
    # from num_prompt_tokens on.
    penalty_token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    # vLLM's bad_words as token sequences: each one's last token is banned when the output
    # ends with the rest (server.common.bad_words).
    bad_words_ids: list[list[int]] = field(default_factory=list)
    # The sequence's output grammar (structured output): the sampler masks the row by it.
    grammar: Any = None
    # None: no logprobs; N: the chosen token's logprob and the N likeliest, of the raw logits
    # ("raw") or of the scores the token was chosen from ("processed").
    logprobs: int | None = None
    logprobs_mode: str = "raw"

    @classmethod
    def from_generation_config(
        cls,
        config: GenerationConfig,
        *,
        generator: Any = None,
        banned_token_ids: list[int] | None = None,
        penalty_token_ids: list[int] | None = None,
        num_prompt_tokens: int = 0,
        bad_words_ids: list[list[int]] | None = None,
    ) -> RowParams:
        """Row parameters for a request's sequence (beam rows are built with ``is_greedy``).

        ``penalty_token_ids`` (the sequence's live token list, whose first
        ``num_prompt_tokens`` are the prompt) is kept only when a penalty or a bad word of
        several tokens reads it.
        """
        uses_token_ids = (
            config.repetition_penalty != 1.0
            or config.presence_penalty != 0.0
            or config.frequency_penalty != 0.0
            or any(len(ids) > 1 for ids in bad_words_ids or [])
        )
        return cls(
            is_greedy=not config.do_sample or config.is_beam_search,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            typical_p=config.typical_p,
            repetition_penalty=config.repetition_penalty,
            presence_penalty=config.presence_penalty,
            frequency_penalty=config.frequency_penalty,
            min_p=config.min_p,
            logit_bias=config.logit_bias,
            allowed_token_ids=config.allowed_token_ids,
            generator=generator,
            banned_token_ids=list(banned_token_ids or []),
            penalty_token_ids=penalty_token_ids if uses_token_ids else None,
            num_prompt_tokens=num_prompt_tokens,
            bad_words_ids=list(bad_words_ids or []),
            logprobs=config.logprobs,
            logprobs_mode=config.logprobs_mode,
        )

    def banned_now(self) -> list[int]:
        """The ids scored -inf this step: the banned ids and the bad words' next tokens."""
        if not self.bad_words_ids:
            return self.banned_token_ids
        bans = bad_word_bans(
            self.bad_words_ids, self.penalty_token_ids or [], self.num_prompt_tokens
        )
        return [*self.banned_token_ids, *bans]

    @property
    def samples(self) -> bool:
        """True when this row draws at random (temperature 0 means greedy, as OpenAI does)."""
        return not self.is_greedy and self.temperature > 0.0

    @property
    def penalised(self) -> bool:
        """True when the repetition penalty changes this row's scores."""
        return self.repetition_penalty != 1.0 and bool(self.penalty_token_ids)

    @property
    def output_penalised(self) -> bool:
        """True when the presence or frequency penalty changes this row's scores: it has one,
        and has generated tokens for it to count."""
        return (
            (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)
            and self.penalty_token_ids is not None
            and len(self.penalty_token_ids) > self.num_prompt_tokens
        )

    @property
    def processes_logits(self) -> bool:
        """True when something changes this row's scores before its argmax (the greedy
        choice), i.e. when the sampler cannot take the raw logits' argmax."""
        return (
            self.samples
            or self.penalised
            or self.output_penalised
            or bool(self.banned_token_ids)
            or bool(self.bad_words_ids)
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or self.grammar is not None
        )
