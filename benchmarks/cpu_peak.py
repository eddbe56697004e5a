"""This CPU's ceilings, and how close each served run came to them.

    python -m benchmarks.cpu_peak [--threads 2] [--model CACHE/real_size/1b/hf]
        [--compare benchmarks/results/real_size_serving_bf16_vs_vllm_cpu.json]

(CACHE: ``$LLM_SUITE_CACHE_DIR``, else ``~/.cache/llm_suite``: the checkpoint
``real_size_serving`` writes.)

A small C++ program (g++ -O2 -march=native, built in a temporary folder) measures:

* the dot-product peaks, GMAC/s: float32 FMA, ``vdpbf16ps`` (bf16 pairs, AVX512-BF16) and
  ``vpdpbusd`` (int8 quads, AVX512-VNNI), each as 12 independent chains in registers per
  thread, on 1 and on ``--threads`` threads (the instructions this CPU lacks are left out);
* the memory's read bandwidth, GB/s: ``--threads`` threads summing a 1 GiB buffer with vector
  loads, best of 5.

From the model's config (``--model``) it prints the ceilings they put on a bf16 model: the
batch-1 TPOT floor (the weights' bytes at the read bandwidth) and, per workload of
``real_size_serving`` (chat: 100 in / 64 out, long: 100 / 512), the output tokens/s at which
the bf16 dot products would run at their peak through prefill and decode. ``--compare`` takes a
``real_size_serving`` JSON and puts each bf16 row against those ceilings: its bandwidth at
concurrency 1 (bytes / TPOT) and its matmul rate (GMAC per output token x output tokens/s).
Quantized rows are skipped: their bytes and dot products differ per layout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import run_environment
from benchmarks.real_size_serving import WORKLOADS
from server.continuous_batching.load_cache import cache_root

DEFAULT_MODEL = cache_root() / "real_size" / "1b" / "hf"  # real_size_serving's 1B checkpoint

PROGRAM = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

using Clock = std::chrono::steady_clock;
constexpr long kIters = 50000000;

template <typename Body>
double per_thread_rate(int num_threads, double macs_per_iter, Body body) {
  std::vector<double> seconds(num_threads);
  std::vector<std::thread> threads;
  for (int t = 0; t < num_threads; ++t)
    threads.emplace_back([&, t] {
      const auto t0 = Clock::now();
      body();
      seconds[t] = std::chrono::duration<double>(Clock::now() - t0).count();
    });
  for (auto& th : threads) th.join();
  double rate = 0;
  for (double s : seconds) rate += kIters * macs_per_iter / s / 1e9;
  return rate;
}

#if defined(__AVX512F__)
#define VEC_F __m512
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET1(x) _mm512_set1_ps(x)
#define ADD(a, b) _mm512_add_ps(a, b)
#define LANES 16
#else
#define VEC_F __m256
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SET1(x) _mm256_set1_ps(x)
#define ADD(a, b) _mm256_add_ps(a, b)
#define LANES 8
#endif

volatile float sink_f;
volatile int sink_i;

void fma_chains() {
  VEC_F acc[12];
  for (auto& a : acc) a = SET1(0.0f);
  VEC_F x = SET1(1e-9f), y = SET1(1.0f);
  for (long i = 0; i < kIters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < 12; ++c) acc[c] = FMA(x, y, acc[c]);
    __asm__ volatile("" : "+x"(x));
  }
  for (int c = 1; c < 12; ++c) acc[0] = ADD(acc[0], acc[c]);  // every chain stays live
  float out[LANES];
  std::memcpy(out, &acc[0], sizeof(out));
  sink_f = out[0];
}

#if defined(__AVX512BF16__)
void bf16_chains() {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = x;
  for (long i = 0; i < kIters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < 12; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], x, y);
    __asm__ volatile("" : "+v"(x));
  }
  for (int c = 1; c < 12; ++c) acc[0] = _mm512_add_ps(acc[0], acc[c]);
  sink_f = _mm512_reduce_add_ps(acc[0]);
}
#endif

#if defined(__AVX512VNNI__)
void int8_chains() {
  __m512i acc[12];
  for (auto& a : acc) a = _mm512_setzero_si512();
  __m512i x = _mm512_set1_epi8(1), y = x;
  for (long i = 0; i < kIters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < 12; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], x, y);
    __asm__ volatile("" : "+v"(x));
  }
  for (int c = 1; c < 12; ++c) acc[0] = _mm512_add_epi32(acc[0], acc[c]);
  sink_i = _mm512_reduce_add_epi32(acc[0]);
}
#endif

double read_bandwidth(int num_threads) {
  const size_t bytes = size_t{1} << 30, per_thread = bytes / num_threads;
  auto* buffer = static_cast<char*>(std::aligned_alloc(4096, bytes));
  std::memset(buffer, 1, bytes);
  double best = 0;
  for (int round = 0; round < 5; ++round) {
    std::vector<std::thread> threads;
    const auto t0 = Clock::now();
    for (int t = 0; t < num_threads; ++t)
      threads.emplace_back([=] {
        // 8 streams a thread, as a matmul reads its column blocks: one stream per thread
        // leaves the memory idle between the hardware prefetcher's requests (about 3/4 of
        // the rate measured here).
        constexpr int kStreams = 8;
        const size_t stream_bytes = per_thread / kStreams;
        const char* p = buffer + t * per_thread;
        __m256i sum[kStreams];
        for (auto& v : sum) v = _mm256_setzero_si256();
        for (size_t i = 0; i < stream_bytes; i += 64)
          for (int s = 0; s < kStreams; ++s) {
            const char* q = p + s * stream_bytes + i;
            sum[s] = _mm256_add_epi64(sum[s], _mm256_load_si256((const __m256i*)q));
            sum[s] = _mm256_add_epi64(sum[s], _mm256_load_si256((const __m256i*)(q + 32)));
          }
        for (int s = 1; s < kStreams; ++s) sum[0] = _mm256_add_epi64(sum[0], sum[s]);
        sink_i = static_cast<int>(_mm256_extract_epi64(sum[0], 0));
      });
    for (auto& th : threads) th.join();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (bytes / s / 1e9 > best) best = bytes / s / 1e9;
  }
  std::free(buffer);
  return best;
}

int main(int argc, char** argv) {
  const int num_threads = argc > 1 ? std::atoi(argv[1]) : 2;
  std::printf("{\"fp32_fma\": [%.1f, %.1f]", per_thread_rate(1, 12.0 * LANES, fma_chains),
              per_thread_rate(num_threads, 12.0 * LANES, fma_chains));
#if defined(__AVX512BF16__)
  std::printf(", \"bf16_dot\": [%.1f, %.1f]", per_thread_rate(1, 12.0 * 32, bf16_chains),
              per_thread_rate(num_threads, 12.0 * 32, bf16_chains));
#endif
#if defined(__AVX512VNNI__)
  std::printf(", \"int8_dot\": [%.1f, %.1f]", per_thread_rate(1, 12.0 * 64, int8_chains),
              per_thread_rate(num_threads, 12.0 * 64, int8_chains));
#endif
  std::printf(", \"read_gb_s\": %.1f}\n", read_bandwidth(num_threads));
}
"""


def measure_peaks(num_threads: int, march: str = "native") -> dict[str, Any]:
    """Build (for ``-march=march``) and run the program: {name: [1 thread, num_threads]
    GMAC/s, read_gb_s: GB/s}."""
    with tempfile.TemporaryDirectory(prefix="cpu_peak_") as folder:
        source, binary = Path(folder) / "peak.cpp", Path(folder) / "peak"
        source.write_text(PROGRAM)
        subprocess.run(
            ["g++", "-O2", f"-march={march}", "-pthread", str(source), "-o", str(binary)],
            check=True,
        )
        out = subprocess.run(
            [str(binary), str(num_threads)], check=True, capture_output=True, text=True
        )
    return json.loads(out.stdout)


def model_macs(config: dict[str, Any]) -> tuple[float, float]:
    """(GMAC of the decoder body per token, GMAC of the lm_head per token) from a llama-shaped
    config: the matmuls only (attention over the context and the norms are left out)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    per_layer += 3 * hidden * inter
    return config["num_hidden_layers"] * per_layer / 1e9, hidden * config["vocab_size"] / 1e9


def ceilings(peaks: dict[str, Any], body: float, head: float) -> dict[str, Any]:
    """What the peaks bound for a bf16 model of these GMAC per token."""
    out: dict[str, Any] = {"batch1_tpot_floor_ms": 2 * (body + head) / peaks["read_gb_s"] * 1e3}
    bf16 = peaks.get("bf16_dot", peaks["fp32_fma"])[1]
    for workload, (num_in, num_out) in WORKLOADS.items():
        # every output token: one decode pass (body + head); its share of the prompt's body
        gmac_per_output = body + head + body * num_in / num_out
        out[f"{workload}_tok_s_ceiling"] = bf16 / gmac_per_output
    return out


def compare(path: Path, peaks: dict[str, Any], body: float, head: float) -> list[dict]:
    """Each bf16 row of a real_size_serving JSON against the ceilings."""
    bf16 = peaks.get("bf16_dot", peaks["fp32_fma"])[1]
    rows = []
    for r in json.loads(path.read_text())["results"]:
        weights = r["weights"].lower()
        if ("bf16" not in weights and "bfloat16" not in weights) or r.get("rate") is not None:
            continue
        num_in, num_out = WORKLOADS[r["workload"]]
        gmac_s = r["output_tok_per_s"] * (body + head + body * num_in / num_out)
        row = {
            "system": r["system"],
            "workload": r["workload"],
            "concurrency": r["concurrency"],
            "output_tok_per_s": round(r["output_tok_per_s"], 1),
            "matmul_gmac_s": round(gmac_s, 1),
            "of_bf16_peak": round(gmac_s / bf16, 3),
        }
        if r["concurrency"] == 1:
            row["read_gb_s"] = round(2 * (body + head) / (r["tpot_p50_ms"] / 1e3), 1)
            row["of_read_bandwidth"] = round(row["read_gb_s"] / peaks["read_gb_s"], 3)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a folder with config.json")
    p.add_argument("--compare", type=Path, nargs="*", default=[], help="real_size_serving JSONs")
    args = p.parse_args()
    peaks = measure_peaks(args.threads)
    print(f"environment: {json.dumps(run_environment())}")
    for name, value in peaks.items():
        if isinstance(value, list):
            one, many = value
            print(f"{name:10s} {one:7.1f} GMAC/s on 1 thread, {many:7.1f} on {args.threads}")
    print(f"read       {peaks['read_gb_s']:7.1f} GB/s on {args.threads} threads")
    config_path = args.model / "config.json"
    if not config_path.exists():
        return
    body, head = model_macs(json.loads(config_path.read_text()))
    print(f"\n{args.model}: {body:.3f} GMAC body + {head:.3f} lm_head per token (bf16 ceilings)")
    for name, value in ceilings(peaks, body, head).items():
        print(f"  {name:24s} {value:8.1f}")
    for path in args.compare:
        print(f"\n{path}:")
        for row in compare(path, peaks, body, head):
            print("  " + json.dumps(row))


if __name__ == "__main__":
    main()
