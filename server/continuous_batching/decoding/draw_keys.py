"""Seeded draws keyed by (seed, choice, position): a resumed stream draws what the first server
would have drawn.

A seeded row does not draw from one generator that runs through the whole request (its state
would then depend on every draw before, which a server that takes over a stream half-way
cannot replay). Each draw seeds the sampler's generator afresh with :func:`draw_key` of the
request's seed, the choice's index and the position of the token in the output (tokens
generated before it), so the draw for token k of choice j is the same on any server, in any
batch, whether or not the stream was resumed in between.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit values that spreads every input bit."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


def draw_key(seed: int, choice_index: int, position: int) -> int:
    """The generator seed (63 bits) for the draw of output token ``position`` of choice
    ``choice_index`` of a request seeded with ``seed``."""
    key = _mix(seed & _MASK64)
    key = _mix(key ^ (choice_index & _MASK64))
    key = _mix(key ^ (position & _MASK64))
    return key >> 1
