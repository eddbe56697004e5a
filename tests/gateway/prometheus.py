"""Reading the gateway's ``/metrics`` (Prometheus text format) in assertions."""

from __future__ import annotations


def metric_value(text: str, sample: str) -> float:
    """The value of the Prometheus sample line starting with ``sample`` (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
