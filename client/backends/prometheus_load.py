"""The queue of an engine read from its Prometheus ``/metrics`` (vLLM's gauges).

vLLM exports ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (and, in V0,
``vllm:num_requests_swapped``), one sample per served model (label ``model_name``); SGLang's
and our own servers' vLLM-compatible series use the same names. The gateway balances on their
sum, as it does on the load our servers report on ``/health``.
"""

from __future__ import annotations

from protocol.health import LoadReport

#: vLLM gauge name -> the ``LoadReport`` field it fills.
_GAUGES = {
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:num_requests_swapped": "num_swapped",
}


def _sample(line: str) -> tuple[str, float] | None:
    """``(metric name, value)`` of one Prometheus sample line, None for comments and junk."""
    if not line or line.startswith("#"):
        return None
    name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
    if name_end <= 0:
        return None
    # The value follows the labels (which may hold spaces inside quotes): the first field
    # after the closing brace, or after the name when there are no labels.
    rest = line[line.rfind("}") + 1 :] if line[name_end] == "{" else line[name_end:]
    fields = rest.split()
    try:
        return line[:name_end], float(fields[0])
    except (IndexError, ValueError):
        return None


def load_from_metrics(text: str) -> LoadReport | None:
    """The queue the vLLM gauges in ``text`` report (summed over models), or None when the
    text has neither the running nor the waiting gauge (then the gateway balances on its own
    in-flight count alone)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        sample = _sample(line.strip())
        if sample is not None and sample[0] in _GAUGES:
            field = _GAUGES[sample[0]]
            totals[field] = totals.get(field, 0.0) + sample[1]
    if "num_running" not in totals and "num_waiting" not in totals:
        return None
    return LoadReport(**{field: int(value) for field, value in totals.items()})
