"""The CB server's ``vllm:`` series, as vLLM's Grafana dashboard and production-stack router read
them: /metrics of a real server parsed with prometheus_client's parser, before and after real
requests (a stop, a length, an aborted stream)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from harness.servers import ServerThread
from harness.waiting import wait_until
from server.common.vllm_metrics import E2E_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from tests.support.default_model import DEMO_QUESTION, MODEL_ID

#: name -> type, as vLLM declares them (counters are parsed without their _total suffix).
EXPECTED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_swapped": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cpu_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}


def _scrape(server: ServerThread) -> dict[str, tuple[str, list[Sample]]]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        family.name: (family.type, family.samples)
        for family in text_string_to_metric_families(text)
        if family.name.startswith("vllm:")
    }


def _value(families: dict, family: str, sample: str, **labels: str) -> float:
    (value,) = [
        s.value
        for s in families[family][1]
        if s.name == sample and s.labels == {"model_name": MODEL_ID, **labels}
    ]
    return value


def _buckets(families: dict, family: str) -> list[float]:
    return [
        float(s.labels["le"])
        for s in families[family][1]
        if s.name == f"{family}_bucket" and s.labels["le"] != "+Inf"
    ]


def test_vllm_series_names_types_labels_buckets_and_values(cb_server: ServerThread) -> None:
    before = _scrape(cb_server)
    assert {name: kind for name, (kind, _) in before.items()} == EXPECTED
    assert _buckets(before, "vllm:time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert _buckets(before, "vllm:time_per_output_token_seconds") == list(TPOT_BUCKETS)
    assert _buckets(before, "vllm:e2e_request_latency_seconds") == list(E2E_BUCKETS)
    assert _value(before, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0.0

    chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": DEMO_QUESTION}]}
    stopped = httpx.post(
        f"{cb_server.url}/v1/chat/completions",
        json={**chat, "max_tokens": 32, "temperature": 0},
        timeout=60,
    ).json()
    assert stopped["choices"][0]["finish_reason"] == "stop", stopped
    cut = httpx.post(
        f"{cb_server.url}/v1/completions",
        json={
            "model": MODEL_ID,
            "prompt": "Once upon a time",
            "max_tokens": 4,
            "n": 2,
            "ignore_eos": True,
        },  # fmt: skip
        timeout=60,
    ).json()
    assert [c["finish_reason"] for c in cut["choices"]] == ["length", "length"]
    # A stream the caller leaves after its first event: its sequence ends as "abort".
    long = {"prompt": "Tell a long story.", "stream": True,
            "generation_config": {"max_new_tokens": 500, "ignore_eos": True}}  # fmt: skip
    with httpx.stream("POST", f"{cb_server.url}/generate", json=long, timeout=60) as answer:
        next(answer.iter_lines())

    def aborted() -> bool:
        after = _scrape(cb_server)
        return _value(after, "vllm:request_success", "vllm:request_success_total",
                      finished_reason="abort") > _value(before, "vllm:request_success",
                      "vllm:request_success_total", finished_reason="abort")  # fmt: skip

    wait_until(aborted, 30, message="the left stream to count as aborted")
    after = _scrape(cb_server)

    def moved(family: str, sample: str, **labels: str) -> float:
        return _value(after, family, sample, **labels) - _value(before, family, sample, **labels)

    success = ("vllm:request_success", "vllm:request_success_total")
    assert moved(*success, finished_reason="stop") == 1
    assert moved(*success, finished_reason="length") == 2
    assert moved(*success, finished_reason="abort") == 1
    usage = stopped["usage"]["prompt_tokens"] + cut["usage"]["prompt_tokens"]
    assert moved("vllm:prompt_tokens", "vllm:prompt_tokens_total") >= usage
    generated = stopped["usage"]["completion_tokens"] + cut["usage"]["completion_tokens"]
    assert moved("vllm:generation_tokens", "vllm:generation_tokens_total") > generated
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert moved(histogram, f"{histogram}_count") == 3  # per prompt: chat, n=2, stream
        assert moved(histogram, f"{histogram}_sum") > 0
    tpot = "vllm:time_per_output_token_seconds"
    assert moved(tpot, f"{tpot}_count") >= generated - 2  # every token after a prompt's first
    # Nothing runs any more (the left stream's sequence is freed at the engine's next step,
    # which may come just after its abort was counted), and the cache gauges are fractions.
    running = ("vllm:num_requests_running", "vllm:num_requests_running")
    wait_until(lambda: _value(_scrape(cb_server), *running) == 0, 30, message="nothing running")
    assert 0.0 <= _value(after, "vllm:gpu_cache_usage_perc", "vllm:gpu_cache_usage_perc") <= 1.0
