"""Prometheus metrics of the model servers (one registry per app, so tests can build many).

Our own ``llm_`` series, and vLLM's ``vllm:`` series beside them (``vllm_metrics``): a
generation service reports each event once, through the ``ServerMetrics`` methods, which feed
both; the embedding server's are ``EmbeddingMetrics``. Both build on ``BaseMetrics``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import ClassVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocol.health import ComputePath, LoadReport
from server.common.vllm_metrics import VllmLoadCollector, VllmMetrics
from utils.asgi import HttpMiddleware

# The *_created series only add noise to a scrape.
disable_created_metrics()

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)
#: The embedding server's: inputs per request, and its (shorter) request latencies.
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_EMBEDDING_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class RequestCounter(HttpMiddleware):
    """ASGI middleware counting POST requests by path and status in ``requests``, and, given a
    ``latency`` histogram, observing their time to the response's start.

    Pure ASGI (``utils.asgi``): streaming answers and client disconnects pass through
    untouched. Every model server (generation and embedding) installs it.
    """

    methods: ClassVar[frozenset[str] | None] = frozenset({"POST"})

    def __init__(self, app: ASGIApp, requests: Counter, latency: Histogram | None = None) -> None:
        super().__init__(app)
        self.requests = requests
        self.latency = latency

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Count the request's answer (and time its start)."""
        started = time.monotonic()

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.requests.labels(scope["path"], str(message["status"])).inc()
                if self.latency is not None:
                    self.latency.observe(time.monotonic() - started)
            await send(message)

        await self.app(scope, receive, counting_send)


class LoadCollector(Collector):
    """Reads a server's load report and counters at scrape time, so nothing is stale: the
    ``llm_`` gauges and counters every model and embedding server exports."""

    def __init__(
        self, read_load: Callable[[], LoadReport], read_counters: Callable[[], dict[str, float]]
    ) -> None:
        self._read_load = read_load
        self._read_counters = read_counters

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        load = self._read_load()
        for name, value in load.model_dump().items():
            if value is not None:
                yield GaugeMetricFamily(f"llm_{name}", f"Current {name.replace('_', ' ')}", value)
        for name, value in self._read_counters().items():
            yield CounterMetricFamily(f"llm_{name}", name.replace("_", " "), value)


class BaseMetrics:
    """What the metrics of every model server (generation and embedding) share: a registry of
    their own, ``llm_requests`` (counted by ``RequestCounter``) and the text exposition.

    Each server adds its series, then registers its load collectors (``LoadCollector``, and the
    vLLM gauges) last, so that a scrape lists the series in the order they were declared.
    """

    #: Observed by ``RequestCounter`` when a server sets it: time to the response's start.
    latency: Histogram | None = None

    def __init__(self, requests_help: str, outcome_label: str) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "llm_requests", requests_help, ["endpoint", outcome_label], registry=self.registry
        )

    def counter(self, name: str, documentation: str) -> Counter:
        """A counter without labels in this server's registry."""
        return Counter(name, documentation, registry=self.registry)

    def histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        """A histogram without labels in this server's registry."""
        return Histogram(name, documentation, buckets=buckets, registry=self.registry)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class ServerMetrics(BaseMetrics):
    """Request outcomes, token counts and latencies of one generation server."""

    def __init__(
        self,
        read_load: Callable[[], LoadReport],
        read_counters: Callable[[], dict[str, float]] = dict,
        model_name: str = "model",
        compute_path: ComputePath | None = None,
    ) -> None:
        super().__init__("Requests by endpoint and outcome", "outcome")
        if compute_path is not None:
            # An info series: which path computes (value 1), so a fleet's CPU paths can be
            # counted and an AVX2-only or torch-ops server found by query.
            Gauge(
                "llm_compute_path_info",
                "What computes the model: device, CPU ISA level (serving and best) and ops",
                ["device", "isa", "best_isa", "decoder_ops"],
                registry=self.registry,
            ).labels(
                compute_path.device,
                compute_path.isa or "",
                compute_path.best_isa or "",
                compute_path.decoder_ops,
            ).set(1)
        self.prompt_tokens = self.counter("llm_prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = self.counter("llm_generation_tokens", "Tokens generated")
        self.time_to_first_token = self.histogram(
            "llm_time_to_first_token_seconds",
            "Time from arrival to the first generated text",
            _LATENCY_BUCKETS,
        )
        self.time_per_output_token = self.histogram(
            "llm_time_per_output_token_seconds",
            "Mean time per generated token after the first, per request",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_latency = self.histogram(
            "llm_e2e_request_latency_seconds",
            "Time from arrival to the last token",
            _LATENCY_BUCKETS,
        )
        self.registry.register(LoadCollector(read_load, read_counters))
        self.vllm = VllmMetrics(self.registry, model_name, read_load)

    def prompt(self, num_tokens: int) -> None:
        """A sequence's prompt entered the engine."""
        self.prompt_tokens.inc(num_tokens)
        self.vllm.prompt_tokens.inc(num_tokens)

    def first_token(self, seconds: float) -> None:
        """A sequence's first token came, ``seconds`` after its arrival."""
        self.time_to_first_token.observe(seconds)
        self.vllm.time_to_first_token.observe(seconds)

    def token_gap(self, seconds: float, num_tokens: int) -> None:
        """``num_tokens`` more tokens came ``seconds`` after the previous ones (vLLM's TPOT
        observes each gap; ours is a mean per sequence, at its end)."""
        for _ in range(num_tokens):
            self.vllm.time_per_output_token.observe(seconds / num_tokens)

    def sequence_done(
        self, e2e_seconds: float, num_tokens: int, first_token_at: float | None, reasons: list[str]
    ) -> None:
        """A sequence ended: its latency, tokens and each choice's finished reason."""
        self.generation_tokens.inc(num_tokens)
        self.vllm.generation_tokens.inc(num_tokens)
        self.e2e_latency.observe(e2e_seconds)
        self.vllm.e2e_request_latency.observe(e2e_seconds)
        if first_token_at is not None and num_tokens > 1:
            self.time_per_output_token.observe(
                (time.monotonic() - first_token_at) / (num_tokens - 1)
            )
        for reason in reasons:
            self.vllm.finished(reason)


class EmbeddingMetrics(BaseMetrics):
    """Requests by status, inputs, tokens, batch sizes and latency of one embedding server,
    with the same load gauges as every model server: ours and vLLM's (the gateway reads those)."""

    def __init__(
        self,
        read_load: Callable[[], LoadReport],
        read_counters: Callable[[], dict[str, float]],
        model_name: str,
    ) -> None:
        super().__init__("Requests answered, by endpoint and status", "status")
        self.inputs = self.counter("llm_embedding_inputs", "Inputs embedded")
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Tokens embedded (special tokens included)",
            ["model_name"],
            registry=self.registry,
        )
        self.model_name = model_name
        self.inputs_per_request = self.histogram(
            "llm_embedding_inputs_per_request", "Inputs per request", _BATCH_BUCKETS
        )
        self.latency = self.histogram(
            "llm_request_duration_seconds",
            "Time from arrival to answer",
            _EMBEDDING_LATENCY_BUCKETS,
        )
        self.registry.register(LoadCollector(read_load, read_counters))
        self.registry.register(VllmLoadCollector(model_name, read_load))

    def observe(self, num_inputs: int, num_tokens: int) -> None:
        """One request embedded."""
        self.inputs.inc(num_inputs)
        self.prompt_tokens.labels(self.model_name).inc(num_tokens)
        self.inputs_per_request.observe(num_inputs)
