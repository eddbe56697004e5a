"""Small text helpers shared by the streaming readers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import AnyStr


def num_held_back(text: AnyStr, prefixes: Iterable[AnyStr]) -> int:
    """How many characters at the end of ``text`` could still begin one of ``prefixes``.

    A streaming reader holds those back until more text tells them apart (a stop string, a
    ``<tool_call>`` or ``</think>`` tag, a secret to redact). A whole prefix found at the end is
    not counted: the caller finds whole ones itself.
    """
    wanted = [p for p in prefixes if p]
    longest = max((len(p) for p in wanted), default=0)
    for size in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-size:]
        if any(p.startswith(tail) for p in wanted):
            return size
    return 0
