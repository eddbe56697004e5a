"""The detokenizer's decode: the Rust tokenizer called directly where that is exactly what
``tokenizer.decode(ids, skip_special_tokens=True)`` gives, transformers' decode otherwise."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from server.common.detokenizer import IncrementalDetokenizer, text_decoder


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path):
    return AutoTokenizer.from_pretrained(default_model_path)


def _windows(tokenizer, num: int) -> list[list[int]]:
    """Random id windows: prose, multi-byte characters split over tokens, special ids."""
    rng = random.Random(0)
    text = "Paris is the capital of France. Grüße, 東京 🚀 naïve café — «quotes»\n\tend"
    ids = tokenizer.encode(text, add_special_tokens=False)
    specials = list(tokenizer.all_special_ids)
    windows = []
    for _ in range(num):
        start = rng.randrange(len(ids))
        window = ids[start : start + rng.randrange(1, 8)]
        if rng.random() < 0.3:
            window.insert(rng.randrange(len(window) + 1), rng.choice(specials))
        windows.append(window + [rng.randrange(tokenizer.vocab_size)])
    return windows


def test_the_rust_decode_gives_what_transformers_decode_gives(tokenizer) -> None:
    decode = text_decoder(tokenizer)
    assert decode is text_decoder(tokenizer)  # decided once per tokenizer
    assert "rust_decode" in decode.__code__.co_freevars  # the fast path was taken
    for window in _windows(tokenizer, 300):
        assert decode(window) == tokenizer.decode(window, skip_special_tokens=True), window


def test_cleanup_on_a_bpe_model_is_still_the_plain_decode(tokenizer) -> None:
    cleaning = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    cleaning.clean_up_tokenization_spaces = True  # transformers ignores it for BPE models
    decode = text_decoder(cleaning)
    assert "rust_decode" in decode.__code__.co_freevars
    ids = tokenizer.encode("Hello , world ! It 's", add_special_tokens=False)
    assert decode(ids) == cleaning.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_overrides_decode_keeps_its_own(tokenizer) -> None:
    class Shouting(type(tokenizer)):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens, **kwargs).upper()

    shouting = Shouting.from_pretrained(tokenizer.name_or_path)
    ids = tokenizer.encode("Paris is nice", add_special_tokens=False)
    assert text_decoder(shouting)(ids) == "PARIS IS NICE"
    detokenizer = IncrementalDetokenizer(shouting)
    assert detokenizer.add_tokens(ids) + detokenizer.flush() == "PARIS IS NICE"
