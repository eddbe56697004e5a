"""vLLM's ``bad_words``: words the output must not contain, banned token by token.

Each word is tokenized twice, as it is and after a space (the form it takes inside text), the
second kept only when it is a different word token of the same length (vLLM's rule). At each
step a word's last token is banned when the output already ends with the word's other tokens
(a one-token word is banned always). Only output tokens are read, never the prompt's: vLLM's
definition. Plain Python: both servers' samplers call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["bad_word_bans", "bad_words_token_ids"]


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """The token sequences ``words`` ban (vLLM's ``get_bad_words_logits_processors``)."""
    sequences: list[list[int]] = []
    for word in words:
        bare = word.lstrip()
        plain = tokenizer.encode(bare, add_special_tokens=False)
        if plain:
            sequences.append(plain)
        spaced = tokenizer.encode(" " + bare, add_special_tokens=False)
        # Inside text the word follows a space; its tokens are another ban only when the
        # space makes a different first token and the same number of tokens.
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            sequences.append(spaced)
    return sequences


def bad_word_bans(
    bad_words_ids: list[list[int]], token_ids: Sequence[int], num_prompt_tokens: int = 0
) -> list[int]:
    """The tokens banned next: each sequence's last token when the output (``token_ids``
    past its first ``num_prompt_tokens``) ends with the rest of it."""
    banned = []
    end = len(token_ids)
    num_output = end - num_prompt_tokens
    for ids in bad_words_ids:
        num_prefix = len(ids) - 1
        if num_prefix == 0 or (
            num_output >= num_prefix and list(token_ids[end - num_prefix : end]) == ids[:-1]
        ):
            banned.append(ids[-1])
    return banned
