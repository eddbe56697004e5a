// bfloat16 matmul for the decoder's linear layers (x [M, K] . W[N, K]^T + bias -> [M, N]) from
// a weight packed once at load, in column blocks of W (one vector of float32 sums: 16 on
// AVX-512 builds, 8 on AVX2) with each K pair of a block in one 32-bit lane per column:
// [ceil(N/W), ceil(K/2), W, 2], zero padded. Threads split the column blocks. Two kernels:
//
// * AVX512-BF16: vdpbf16ps multiplies bf16 pairs exactly and sums in float32. A register tile
//   of 4 rows x 6 blocks keeps its sums in 24 registers. Measured against oneDNN's prepacked
//   matmul (bf16, 2 threads): 1.1-1.2x at 32 rows, 1.6-3x at 1 row (oneDNN's per-call cost is
//   ~15 us), even at 256 rows.
// * elsewhere (AVX2, AVX-512 without BF16): the weight stays bf16 in memory (half the bytes of
//   float32: a decode step is bound by memory bandwidth) and is widened in registers, a 16-bit
//   shift for a pair's first element and a mask for its second; x is widened once per call.
//   Products of bf16 values are exact in float32, so both kernels round once, at the end.
#pragma once

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

// Rows [0, rows) (rows <= MR; FULL: rows == MR) of x against NV column blocks from b.
template <int MR, int NV, bool FULL>
inline void gemm_tile(const uint16_t* a, int64_t lda, const __m512bh* b, int64_t kp, int64_t k,
                      const float* bias, int64_t n, int64_t col0, uint16_t* c, int64_t ldc,
                      int64_t rows) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const int64_t num_pairs = k / 2;
  for (int64_t p = 0; p < num_pairs; ++p) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = b[v * kp + p];
    for (int m = 0; m < MR; ++m) {
      if (!FULL && m >= rows) break;
      int32_t pair;
      std::memcpy(&pair, a + m * lda + 2 * p, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], av, bv[v]);
    }
  }
  if (k % 2) {  // odd K: the last pair's second element is the zero padding
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = b[v * kp + num_pairs];
    for (int m = 0; m < MR; ++m) {
      if (!FULL && m >= rows) break;
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(a[m * lda + k - 1]));
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], av, bv[v]);
    }
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

void run_gemm(const at::Tensor& x, const at::Tensor& packed, const GemmCall& g) {
  const uint16_t* a = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const __m512bh* b = reinterpret_cast<const __m512bh*>(packed.data_ptr<at::BFloat16>());
  const int64_t lda = x.stride(0), m = g.m, n = g.n, nb = g.nb, kp = g.kp, k = g.k;
  constexpr int MR = kGemmRows, NV = kGemmBlocks;
  const int64_t num_groups = (nb + NV - 1) / NV;
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int64_t j = grp * NV;
      if (j + NV > nb) {  // the last, narrower group: one block at a time
        for (int64_t jj = j; jj < nb; ++jj)
          for (int64_t r = 0; r < m; r += MR)
            gemm_tile<MR, 1, false>(a + r * lda, lda, b + jj * kp, kp, k, g.bias, n,
                                    jj * kColBlock, g.c + r * n, n, std::min<int64_t>(MR, m - r));
        continue;
      }
      for (int64_t r = 0; r < m; r += MR) {
        const int64_t rows = std::min<int64_t>(MR, m - r);
        if (rows == MR)
          gemm_tile<MR, NV, true>(a + r * lda, lda, b + j * kp, kp, k, g.bias, n, j * kColBlock,
                                  g.c + r * n, n, rows);
        else
          gemm_tile<MR, NV, false>(a + r * lda, lda, b + j * kp, kp, k, g.bias, n, j * kColBlock,
                                   g.c + r * n, n, rows);
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
