// bfloat16 matmul for the decoder's linear layers (x [M, K] . W[N, K]^T + bias -> [M, N]) from
// a weight packed once at load, in column blocks of W (one vector of float32 sums: 16 on
// AVX-512 builds, 8 on AVX2) with each K pair of a block in one 32-bit lane per column:
// [ceil(N/W), ceil(K/2), W, 2], zero padded. Threads split the column blocks. Two kernels:
//
// * AVX512-BF16: vdpbf16ps multiplies bf16 pairs exactly and sums in float32. A register tile
//   of 4 rows x 6 blocks (8 x 3 at 5-8 rows, so that the weights are read once) keeps its
//   sums in 24 registers. From 9 rows on, the next panel of weights is prefetched into L2 under
//   the current one's dot products, and a long K is cut into chunks that fit L2 with it. On
//   the 1B model's shapes (2 threads, Zen 5, dot product peak ~500 GMAC/s): 193 GMAC/s at 8
//   rows (memory-bound), 399 at 32 and 488 at 256 (175, 331 and 452 before); against oneDNN's
//   prepacked bf16 matmul 1.6-3x at 1 row (oneDNN's per-call cost is ~15 us).
// * elsewhere (AVX2, AVX-512 without BF16): the weight stays bf16 in memory (half the bytes of
//   float32: a decode step is bound by memory bandwidth) and is widened in registers, a 16-bit
//   shift for a pair's first element and a mask for its second; x is widened once per call.
//   Products of bf16 values are exact in float32, so both kernels round once, at the end.
#pragma once

#include <unistd.h>

#include "simd.h"

namespace {

#if defined(LLM_SUITE_HAS_SIMD)
constexpr int64_t kColBlock = Simd::W;

at::Tensor pack_bf16_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "weight must be [N, K] bfloat16");
  const auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1);
  const int64_t nb = (n + kColBlock - 1) / kColBlock, kp = (k + 1) / 2;
  auto out = at::zeros({nb, kp, kColBlock, 2}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < kColBlock && b * kColBlock + c < n; ++c) {
        const uint16_t* row = src + (b * kColBlock + c) * k;
        for (int64_t i = 0; i < k; ++i) dst[((b * kp + i / 2) * kColBlock + c) * 2 + i % 2] = row[i];
      }
  });
  return out;
}

// What both kernels share: the shapes, the float32 bias, the output.
struct GemmCall {
  int64_t m, k, n, nb, kp;
  const float* bias;
  uint16_t* c;
};

#if defined(__AVX512BF16__)
constexpr const char* kGemmKind = "AVX512-BF16 dot products";
constexpr int kGemmRows = 4, kGemmBlocks = 6;
// Fewer row tiles than this: no prefetch and no K chunks (at 1-8 rows the step is bound by
// memory, and a second stream only competes with the first: 10-17% slower at 1 and 8 rows).
constexpr int64_t kMinPrefetchTiles = 3;

// The next unit's weight lines, prefetched into L2 one or two per K pair while this unit's
// row tiles compute. Without it, a panel's first row tile waits on memory and the others find
// the panel in L2 (at 32 rows a quarter of the time went there); with it, the memory stream
// runs under the dot products.
struct PanelPrefetch {
  const char* block = nullptr;  // the current block's line at pair 0 (of the next unit)
  int64_t pair = 0, num_pairs = 0, block_stride = 0, num_left = 0;
  bool is_double = false;  // two lines per K pair (fewer than kGemmBlocks row tiles)

  inline void line() {
    if (num_left <= 0) return;
    _mm_prefetch(block + pair * 64, _MM_HINT_T1);
    --num_left;
    if (++pair == num_pairs) {
      pair = 0;
      block += block_stride;
    }
  }
  inline void step() {
    line();
    if (is_double) line();
  }
};

// Rows [0, rows) (rows <= MR; FULL: rows == MR) of x against NV column blocks from b over K
// pairs [p0, p1), and the odd-K tail pair when `tail`. The sums start at zero, or from acc_in
// (float32 rows of NV * 16); they go to acc_out, or, where that is null, get the bias and are
// rounded to bf16 into c.
//
// Not inlined: inlined into run_gemm's loop, the 1-row (memory-bound) matmuls ran 8% slower.
template <int MR, int NV, bool FULL, bool PREFETCH>
__attribute__((noinline)) void gemm_tile(const uint16_t* a, int64_t lda, const __m512bh* b,
                                         int64_t kp, int64_t p0, int64_t p1, bool tail, int64_t k,
                                         const float* acc_in, float* acc_out, const float* bias,
                                         int64_t n, int64_t col0, uint16_t* c, int64_t ldc,
                                         int64_t rows, PanelPrefetch prefetch) {
  constexpr int64_t ld = NV * 16;
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v)
      acc[m][v] = acc_in && (FULL || m < rows) ? _mm512_loadu_ps(acc_in + m * ld + v * 16)
                                               : _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = b[v * kp + p];
    if constexpr (PREFETCH) prefetch.step();
    for (int m = 0; m < MR; ++m) {
      if (!FULL && m >= rows) break;
      int32_t pair;
      std::memcpy(&pair, a + m * lda + 2 * p, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], av, bv[v]);
    }
  }
  if (tail) {  // odd K: the last pair's second element is the zero padding
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = b[v * kp + k / 2];
    for (int m = 0; m < MR; ++m) {
      if (!FULL && m >= rows) break;
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(a[m * lda + k - 1]));
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], av, bv[v]);
    }
  }
  if (acc_out) {
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v)
        if (FULL || m < rows) _mm512_storeu_ps(acc_out + m * ld + v * 16, acc[m][v]);
    return;
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t col = col0 + v * kColBlock, left = n - col;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 bias_v = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      if (!FULL && m >= rows) break;
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][v], bias_v));  // nearest even
      _mm256_mask_storeu_epi16(c + m * ldc + col, mask, (__m256i)r);
    }
  }
}

// K pairs per unit: a unit's panel and the next one's, prefetched, within 3/4 of this core's L2
// (a K of 2048 stays whole on a 1 MB L2; the MLP's down projection, K 8192, takes 4 units).
// x is not counted: its rows are read in order, which the hardware prefetcher follows.
inline int64_t gemm_chunk_pairs(int64_t kp) {
  static const int64_t l2_bytes = [] {
    const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return size > 0 ? static_cast<int64_t>(size) : int64_t{1} << 20;
  }();
  const int64_t max_pairs = std::max<int64_t>(64, l2_bytes * 3 / 4 / (2 * kGemmBlocks * 64));
  const int64_t num_chunks = (kp + max_pairs - 1) / max_pairs;
  return (kp + num_chunks - 1) / num_chunks;
}

// The last column group, narrower than kGemmBlocks blocks: its own register tile (a tile one
// block wide has 4 chains of dot products, too few to fill the pipes), all of K at once.
inline void gemm_narrow_group(const uint16_t* a, int64_t lda, const __m512bh* b, int64_t kp,
                              int64_t k, const float* bias, int64_t n, int64_t col0, uint16_t* c,
                              int64_t m, int64_t num_blocks) {
  constexpr int MR = kGemmRows;
  for (int64_t r = 0; r < m; r += MR) {
    auto tile = [&](auto nv) {
      gemm_tile<MR, decltype(nv)::value, false, false>(
          a + r * lda, lda, b, kp, 0, k / 2, k % 2, k, nullptr, nullptr, bias, n, col0,
          c + r * n, n, std::min<int64_t>(MR, m - r), PanelPrefetch{});
    };
    switch (num_blocks) {
      case 1: tile(Const<1>{}); break;
      case 2: tile(Const<2>{}); break;
      case 3: tile(Const<3>{}); break;
      case 4: tile(Const<4>{}); break;
      default: tile(Const<5>{}); break;
    }
  }
}

// Threads split the column groups (kGemmBlocks blocks each). A thread works through its groups
// in units of (group, K chunk): every row tile of a unit, then the next unit, whose weights are
// prefetched meanwhile. A group's sums wait between its K chunks in a float32 buffer. At 1-8
// rows (one or two row tiles) K stays whole and nothing is prefetched.
void run_gemm(const at::Tensor& x, const at::Tensor& packed, const GemmCall& g) {
  const uint16_t* a = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const __m512bh* b = reinterpret_cast<const __m512bh*>(packed.data_ptr<at::BFloat16>());
  const int64_t lda = x.stride(0), m = g.m, n = g.n, nb = g.nb, kp = g.kp, k = g.k;
  constexpr int MR = kGemmRows, NV = kGemmBlocks;
  constexpr int64_t ld = NV * 16;
  const int64_t num_groups = (nb + NV - 1) / NV, num_pairs = k / 2;
  const int64_t num_tiles = (m + MR - 1) / MR;
  const bool is_prefetched = num_tiles >= kMinPrefetchTiles;
  // Without the prefetch, K stays whole: at 1-8 rows a chunk's end breaks the hardware
  // prefetcher's streams (1 row: 8% slower with the down projection in chunks).
  const int64_t chunk = is_prefetched ? gemm_chunk_pairs(kp) : kp;
  const int64_t num_chunks = std::max<int64_t>(1, (num_pairs + chunk - 1) / chunk);
  // Lines of the next unit per K pair: the first NV row tiles share its NV * pairs lines.
  const int64_t lines_per_pair = (NV + std::min<int64_t>(num_tiles, NV) - 1) /
                                 std::min<int64_t>(num_tiles, NV);
  const int64_t block_bytes = kp * 64;
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> sums(num_chunks > 1 ? m * ld : 0);
    for (int64_t grp = g0; grp < g1; ++grp) {
      const __m512bh* bj = b + grp * NV * kp;
      const int64_t col = grp * NV * kColBlock;
      if ((grp + 1) * NV > nb) {
        gemm_narrow_group(a, lda, bj, kp, k, g.bias, n, col, g.c, m, nb - grp * NV);
        continue;
      }
      if (num_tiles == 2) {  // 5-8 rows: 8 x 3 tiles read the group's weights once, not twice
        for (int h = 0; h < 2; ++h) {
          auto tile = [&](auto full) {
            gemm_tile<2 * MR, NV / 2, decltype(full)::value, false>(
                a, lda, bj + h * (NV / 2) * kp, kp, 0, num_pairs, k % 2, k, nullptr, nullptr,
                g.bias, n, col + h * (NV / 2) * kColBlock, g.c, n, m, PanelPrefetch{});
          };
          m == 2 * MR ? tile(std::true_type{}) : tile(std::false_type{});
        }
        continue;
      }
      for (int64_t ci = 0; ci < num_chunks; ++ci) {
        const int64_t p0 = ci * chunk, p1 = std::min(num_pairs, p0 + chunk);
        const bool is_last = ci + 1 == num_chunks;
        // The next unit: this group's next K chunk, or the next group's first.
        const char* next = nullptr;
        int64_t next_pairs = 0, next_blocks = NV;
        if (!is_last) {
          next = reinterpret_cast<const char*>(bj + p1);
          next_pairs = std::min(num_pairs, p1 + chunk) - p1;
        } else if (grp + 1 < g1) {
          next = reinterpret_cast<const char*>(bj + NV * kp);
          next_pairs = std::min(num_pairs, chunk);
          next_blocks = std::min<int64_t>(NV, nb - (grp + 1) * NV);
        }
        const int64_t num_lines = next_blocks * next_pairs, span = (p1 - p0) * lines_per_pair;
        for (int64_t t = 0; t < num_tiles; ++t) {
          const int64_t r = t * MR, rows = std::min<int64_t>(MR, m - r), first = t * span;
          PanelPrefetch prefetch;
          if (is_prefetched && next && first < num_lines)
            prefetch = PanelPrefetch{next + (first / next_pairs) * block_bytes, first % next_pairs,
                                     next_pairs, block_bytes, std::min(span, num_lines - first),
                                     lines_per_pair > 1};
          const float* acc_in = ci > 0 ? sums.data() + r * ld : nullptr;
          float* acc_out = is_last ? nullptr : sums.data() + r * ld;
          const bool tail = is_last && (k % 2);
          auto tile = [&](auto full, auto with_prefetch) {
            gemm_tile<MR, NV, decltype(full)::value, decltype(with_prefetch)::value>(
                a + r * lda, lda, bj, kp, p0, p1, tail, k, acc_in, acc_out, g.bias, n, col,
                g.c + r * n, n, rows, prefetch);
          };
          using True = std::true_type;
          using False = std::false_type;
          if (prefetch.num_left > 0)
            rows == MR ? tile(True{}, True{}) : tile(False{}, True{});
          else
            rows == MR ? tile(True{}, False{}) : tile(False{}, False{});
        }
      }
    }
  });
}
#else
constexpr const char* kGemmKind = "bf16 widened to float32 in registers";

// Rows [0, rows) of the widened x against NV column blocks from b (32-bit lanes, one bf16 pair
// each). SPLIT keeps separate sums for a pair's first and second element: twice the
// independent FMA chains, for single rows, where there are few.
template <int MR, int NV, bool SPLIT>
inline void widened_tile(const float* a, int64_t lda, const uint32_t* b, int64_t kp, int64_t k,
                         const float* bias, int64_t n, int64_t col0, uint16_t* c, int64_t ldc,
                         int64_t rows) {
  using S = Simd;
  using F = S::F;
  constexpr int W = S::W, NS = SPLIT ? 2 : 1;
  F acc[MR][NV][NS];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v)
      for (int s = 0; s < NS; ++s) acc[m][v][s] = S::zero();
  const int64_t num_pairs = k / 2;
  for (int64_t p = 0; p < num_pairs; ++p) {
    F first[NV], second[NV];
    for (int v = 0; v < NV; ++v) {
      const auto bits = S::load_bits(b + (v * kp + p) * W);
      first[v] = S::pair_first(bits);
      second[v] = S::pair_second(bits);
    }
    for (int m = 0; m < MR; ++m) {
      if (m >= rows) break;
      const F x0 = S::set1(a[m * lda + 2 * p]), x1 = S::set1(a[m * lda + 2 * p + 1]);
      for (int v = 0; v < NV; ++v) {
        acc[m][v][0] = S::fmadd(x0, first[v], acc[m][v][0]);
        acc[m][v][NS - 1] = S::fmadd(x1, second[v], acc[m][v][NS - 1]);
      }
    }
  }
  if (k % 2) {  // odd K: the last pair's second element is the zero padding
    for (int v = 0; v < NV; ++v) {
      const F first = S::pair_first(S::load_bits(b + (v * kp + num_pairs) * W));
      for (int m = 0; m < MR && m < rows; ++m)
        acc[m][v][0] = S::fmadd(S::set1(a[m * lda + k - 1]), first, acc[m][v][0]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t col = col0 + v * W, left = n - col;
    if (left <= 0) break;
    const int count = static_cast<int>(std::min<int64_t>(left, W));
    alignas(64) float bias_lanes[W] = {0.0f};
    if (bias) std::memcpy(bias_lanes, bias + col, count * sizeof(float));
    const F bias_v = S::load(bias_lanes);
    for (int m = 0; m < MR && m < rows; ++m) {
      F sum = acc[m][v][0];
      if constexpr (SPLIT) sum = S::add(sum, acc[m][v][1]);
      S::store_bf16(c + m * ldc + col, S::add(sum, bias_v), count);
    }
  }
}

void run_gemm(const at::Tensor& x, const at::Tensor& packed, const GemmCall& g) {
  const auto xf = x.to(at::kFloat).contiguous();  // widened once: every tile broadcasts from it
  const float* a = xf.data_ptr<float>();
  const uint32_t* b = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t m = g.m, n = g.n, nb = g.nb, kp = g.kp, k = g.k, lda = k;
  constexpr int MR = Simd::kTileRows, NV = Simd::kTileBlocks, G = Simd::kGroupBlocks;
  static_assert(G % NV == 0, "a column group is whole tiles");
  const int64_t block_stride = kp * kColBlock;  // 32-bit lanes per column block
  at::parallel_for(0, (nb + G - 1) / G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int64_t j = grp * G, num_blocks = std::min<int64_t>(G, nb - j);
      const uint32_t* bj = b + j * block_stride;
      const int64_t col = j * kColBlock;
      int64_t r = 0;
      for (; r + MR <= m; r += MR) {  // whole row tiles, the group's weights hot in cache
        int64_t v = 0;
        for (; v + NV <= num_blocks; v += NV)
          widened_tile<MR, NV, false>(a + r * lda, lda, bj + v * block_stride, kp, k, g.bias, n,
                                      col + v * kColBlock, g.c + r * n, n, MR);
        for (; v < num_blocks; ++v)
          widened_tile<MR, 1, false>(a + r * lda, lda, bj + v * block_stride, kp, k, g.bias, n,
                                     col + v * kColBlock, g.c + r * n, n, MR);
      }
      for (; r < m; ++r) {  // the last rows (all of them at batch 1-3), one at a time
        if (num_blocks == G) {
          widened_tile<1, G, true>(a + r * lda, lda, bj, kp, k, g.bias, n, col, g.c + r * n, n, 1);
        } else {
          for (int64_t v = 0; v < num_blocks; ++v)
            widened_tile<1, 1, true>(a + r * lda, lda, bj + v * block_stride, kp, k, g.bias, n,
                                     col + v * kColBlock, g.c + r * n, n, 1);
        }
      }
    }
  });
}
#endif

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be [M, K] bfloat16 rows");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kColBlock,
              "packed weight expected (pack_bf16_weight of this build)");
  const int64_t m = x.size(0), k = x.size(1), nb = packed.size(0), kp = packed.size(1);
  TORCH_CHECK(kp == (k + 1) / 2 && nb == (n + kColBlock - 1) / kColBlock,
              "the packed weight does not match x or n");
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  at::Tensor bias_f;
  const float* bp = nullptr;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias size");
    bias_f = bias->to(at::kFloat).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  run_gemm(x, packed, GemmCall{m, k, n, nb, kp, bp, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>())});
  return out;
}
#endif

}  // namespace
