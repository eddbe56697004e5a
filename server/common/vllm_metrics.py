"""The ``vllm:`` Prometheus series, so that vLLM's Grafana dashboard, its production-stack router
and autoscalers written for vLLM read our servers unchanged.

Names, types, label names (``model_name``, ``finished_reason``) and histogram buckets are
vLLM's (its V1 engine's ``loggers.py``). The cache gauges are fractions in [0, 1] as in vLLM
(despite "perc"); ``gpu_cache_usage_perc`` (vLLM V0) and ``kv_cache_usage_perc`` (V1) carry the
same value, since dashboards of both generations are in use. ``time_per_output_token_seconds``
observes every gap between two generated tokens, as vLLM does, not a mean per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from protocol.health import LoadReport

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

#: vLLM's finished reasons; ours are the same words (stop, length, abort).
FINISHED_REASONS = ("stop", "length", "abort")


class VllmLoadCollector(Collector):
    """The queue and cache gauges, read from the backend's load report at scrape time."""

    def __init__(self, model_name: str, read_load: Callable[[], LoadReport]) -> None:
        self._model_name = model_name
        self._read_load = read_load

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(f"vllm:{name}", documentation, labels=["model_name"])
        gauge.add_metric([self._model_name], value)
        return gauge

    def collect(self) -> Iterator[GaugeMetricFamily]:
        load = self._read_load()
        yield self._gauge("num_requests_running", "Requests in model execution batches.",
                          load.num_running)  # fmt: skip
        yield self._gauge("num_requests_waiting", "Requests waiting to be processed.",
                          load.num_waiting)  # fmt: skip
        yield self._gauge("num_requests_swapped", "Requests swapped to CPU.", load.num_swapped)
        used = _usage(load.num_kv_blocks_free, load.num_kv_blocks_total)
        if used is not None:
            yield self._gauge("gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent.", used)
            yield self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.", used)
        cpu = _usage(load.num_cpu_kv_blocks_free, load.num_cpu_kv_blocks_total)
        if cpu is not None:
            yield self._gauge("cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent.",
                              cpu)  # fmt: skip


def _usage(free: int | None, total: int | None) -> float | None:
    """The used share of a block pool, or None for a server without one."""
    if free is None or not total:
        return None
    return (total - free) / total


class VllmMetrics:
    """vLLM's request metrics for one served model, in ``registry``."""

    def __init__(
        self, registry: CollectorRegistry, model_name: str, read_load: Callable[[], LoadReport]
    ) -> None:
        labels = ["model_name"]
        self.model_name = model_name

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, documentation, labels, buckets=buckets, registry=registry)
            return metric.labels(model_name)

        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=registry
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            labels,
            registry=registry,
        ).labels(model_name)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        # Every reason exists from the start (at 0), so that rate() sees the first increment.
        self.request_success = {r: self._success.labels(model_name, r) for r in FINISHED_REASONS}
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )  # fmt: skip
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            TPOT_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            E2E_BUCKETS,
        )
        registry.register(VllmLoadCollector(model_name, read_load))

    def finished(self, reason: str) -> None:
        """Count one finished sequence (one choice) by vLLM's finished reason."""
        counter = self.request_success.get(reason)
        if counter is None:  # a reason vLLM has no word for: counted with its own label
            counter = self.request_success[reason] = self._success.labels(self.model_name, reason)
        counter.inc()
