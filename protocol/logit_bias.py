"""OpenAI's ``logit_bias``, parsed from its JSON form (``{"50256": -100}``)."""

from __future__ import annotations

import math
import re
from typing import Any

#: OpenAI's bounds of a ``logit_bias`` value: -100 bans a token in practice, +100 forces it.
MAX_LOGIT_BIAS = 100.0
#: A ``logit_bias`` key: a token id, written in decimal (JSON object keys are strings).
_TOKEN_ID_KEY = re.compile(r"[0-9]+")


def parse_logit_bias(value: Any) -> Any:
    """``logit_bias`` as ``{token id: bias}``, from OpenAI's JSON form ``{"50256": -100}``.

    Keys must be token ids (non-negative integers, or strings of decimal digits as JSON
    carries them) and values numbers in ``[-100, 100]``; a ``ValueError`` names the first
    bad entry. Whether an id is in the model's vocabulary is checked by the server, which
    knows the vocabulary. Anything that is not a mapping is left to pydantic's type check.
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        return value
    parsed: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, bool) or not (
            (isinstance(key, int) and key >= 0)
            or (isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key))
        ):
            raise ValueError(f"key {key!r} is not a token id (a non-negative integer)")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise ValueError(f"the bias of token {key} must be a number, got {bias!r}")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise ValueError(
                f"the bias of token {key} is {bias!r}; it must be between "
                f"{-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}"
            )
        parsed[int(key)] = float(bias)
    return parsed
