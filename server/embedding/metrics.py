"""Prometheus metrics of the embedding server: our ``llm_`` series and the vLLM gauges the
gateway (and vLLM's dashboards) read the queue from."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from protocol.health import LoadReport
from server.common.metrics import LoadCollector
from server.common.vllm_metrics import VllmLoadCollector

# The *_created series only add noise to a scrape.
disable_created_metrics()

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class EmbeddingMetrics:
    """Requests by status, inputs, tokens, batch sizes and latency of one embedding server."""

    def __init__(
        self,
        read_load: Callable[[], LoadReport],
        read_counters: Callable[[], dict[str, float]],
        model_name: str,
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "llm_requests",
            "Requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.inputs = Counter("llm_embedding_inputs", "Inputs embedded", registry=self.registry)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Tokens embedded (special tokens included)",
            ["model_name"],
            registry=self.registry,
        )
        self.inputs_per_request = Histogram(
            "llm_embedding_inputs_per_request",
            "Inputs per request",
            buckets=_BATCH_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "llm_request_duration_seconds",
            "Time from arrival to answer",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.model_name = model_name
        # The same load gauges as every model server: ours and vLLM's (the gateway reads those).
        self.registry.register(LoadCollector(read_load, read_counters))
        self.registry.register(VllmLoadCollector(model_name, read_load))

    def observe(self, num_inputs: int, num_tokens: int) -> None:
        """One request embedded."""
        self.inputs.inc(num_inputs)
        self.prompt_tokens.labels(self.model_name).inc(num_tokens)
        self.inputs_per_request.observe(num_inputs)

    def render(self) -> bytes:
        """The Prometheus text of every series."""
        return generate_latest(self.registry)
