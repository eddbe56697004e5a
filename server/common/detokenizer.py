"""Incremental detokenization with stop strings, shared by both batching engines.

Text is emitted only once it is final: never half a UTF-8 character (byte-level BPE can split
one over several tokens), and never the start of what may turn out to be a stop string.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from protocol.generation import GenerationConfig
from utils.text import num_held_back

REPLACEMENT_CHAR = "\ufffd"

#: Per tokenizer, its decode function for each ``skip_special_tokens``.
_DECODERS: weakref.WeakKeyDictionary[Any, dict[bool, Callable[[list[int]], str]]] = (
    weakref.WeakKeyDictionary()
)


def _is_plain_rust_decode(tokenizer: Any) -> bool:
    """True when ``tokenizer.decode(ids, skip_special_tokens=True)`` is exactly its Rust
    tokenizer's decode: a transformers tokenizers backend whose ``_decode`` no subclass
    overrides and that cleans up no spaces afterwards (it never does for BPE models)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    if not isinstance(tokenizer, TokenizersBackend):
        return False
    if type(tokenizer)._decode is not TokenizersBackend._decode:
        return False
    if not tokenizer.clean_up_tokenization_spaces:
        return True
    is_bpe = type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
    forced = getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
    )
    return is_bpe and not forced


def text_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """``ids -> text`` as ``tokenizer.decode(ids, skip_special_tokens=...)`` makes it.

    Where that is the Rust tokenizer's own decode, it is called directly: transformers'
    wrapper costs about five times the decode itself, per token and sequence, which at a
    GPU's batch of 256 was the largest part of a decode step's host time."""
    try:
        return _DECODERS[tokenizer][skip_special_tokens]
    except (KeyError, TypeError):
        pass
    skip = skip_special_tokens
    if _is_plain_rust_decode(tokenizer):
        rust_decode = tokenizer.backend_tokenizer.decode

        def decode(ids: list[int]) -> str:
            return rust_decode(ids, skip_special_tokens=skip)
    else:

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip)

    try:
        _DECODERS.setdefault(tokenizer, {})[skip] = decode
    except TypeError:  # not weak-referenceable: decide again next time
        pass
    return decode


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas and detects stop strings."""

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str] | None = None,
        *,
        skip_special_tokens: bool = True,
        is_stop_included: bool = False,
    ) -> None:
        self._decode = text_decoder(tokenizer, skip_special_tokens)
        # include_stop_str_in_output: the text ends after the stop string, not before it.
        self._is_stop_included = is_stop_included
        self._stop = [s for s in (stop or []) if s]
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # decoded text so far (truncated at a stop string once found)
        self._num_emitted_chars = 0
        self.is_stopped = False

    @property
    def text(self) -> str:
        """All text decoded so far (cut before a matched stop string)."""
        return self._text

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens and return the new final text (maybe empty).

        After a stop string matched, ``is_stopped`` is true and further tokens are ignored.
        """
        if self.is_stopped:
            return ""
        self._token_ids.extend(token_ids)
        # Decode a window that starts a little before the unread part so that
        # tokenizers that merge across tokens (spaces, multi-byte chars) decode right.
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if full_text.endswith(REPLACEMENT_CHAR) or len(full_text) < len(prefix_text):
            return self._release(is_final=False)  # an incomplete character: wait
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        search_from = max(0, len(self._text) - self._max_stop_len + 1)
        self._text += new_text
        if self._stop:
            cut = self._find_stop(search_from)
            if cut is not None:
                self._text = self._text[:cut]
                self.is_stopped = True
                return self._release(is_final=True)
        return self._release(is_final=False)

    def resume(self, token_ids: list[int], num_emitted_chars: int) -> None:
        """Continue a stream another detokenizer began: ``token_ids`` were added there and
        ``num_emitted_chars`` characters of their text released. What it held back is
        released here later (or cut by a stop string that the next tokens complete)."""
        self.add_tokens(token_ids)
        self._num_emitted_chars = min(num_emitted_chars, len(self._text))

    @classmethod
    def for_config(cls, tokenizer: Any, config: GenerationConfig) -> IncrementalDetokenizer:
        """A detokenizer for a request's ``config``: its stop strings, whether they stay in
        the text, and whether special tokens' text is skipped."""
        return cls(
            tokenizer,
            config.stop,
            skip_special_tokens=config.skip_special_tokens,
            is_stop_included=config.include_stop_str_in_output,
        )

    def _find_stop(self, search_from: int) -> int | None:
        """Where the text ends at the first stop string found: before it, or after it when
        the request keeps it."""
        found = [(p, len(s)) for s in self._stop if (p := self._text.find(s, search_from)) >= 0]
        if not found:
            return None
        position, length = min(found)
        return position + length if self._is_stop_included else position

    def _release(self, is_final: bool) -> str:
        num_held = 0 if is_final else num_held_back(self._text, self._stop)
        end = len(self._text) - num_held
        if end <= self._num_emitted_chars:
            return ""
        delta = self._text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta

    def flush(self) -> str:
        """Release everything held back (call when the sequence has finished)."""
        if not self.is_stopped and self._read_offset < len(self._token_ids):
            # Trailing tokens that never formed a full character: emit what decodes.
            full_text = self._decode(self._token_ids[self._prefix_offset :])
            prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
            self._text += full_text[len(prefix_text) :]
            self._read_offset = len(self._token_ids)
        return self._release(is_final=True)
