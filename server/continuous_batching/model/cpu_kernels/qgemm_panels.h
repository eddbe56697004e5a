// Prefill through packed weights on AVX512-BF16 builds: with int8 activations (the fast mode)
// and 32 or more bf16 rows of x, the weight is dequantised to bf16 eight rows at a time (scale
// * code - offset in float32, rounded to nearest even) and multiplied with vdpbf16ps, which
// multiplies bf16 pairs exactly and sums in float32. The integer kernels (qgemm_super.h) reach
// about 250 GMAC/s on a 2-core Zen 5 where vdpbf16ps reaches about 490, and dequantising a
// weight row costs a handful of vector ops per 16 weights, shared by every row of x. The
// super-block layouts (K-quants, GPTQ g128) go to the VNNI GEMM instead (qgemm_vnni.h, about
// 550 GMAC/s there); these panels serve the per-group layouts (Q8_0, Q4_0, Q4_1).
//
// The product is computed transposed, out^T = W . x^T: x is packed once per call into the bf16
// matmul's column-block layout (gemm.h: 16 rows of x a block, K pairs in 32-bit lanes), so a
// dequantised weight row is used as it comes out (contiguous K) and broadcast pair by pair,
// as gemm.h broadcasts x. What it costs against the int8 path: the weight rounded to bf16
// (relative error below 2^-8 per weight) instead of x rounded to int8 per super-block.
#pragma once

#include "gemm.h"
#include "qgemm_super.h"

namespace {

#if defined(__AVX512BF16__) && defined(LLM_SUITE_HAS_SIMD)
#define LLM_SUITE_HAS_QUANT_PANELS 1

// Fewer rows of x stay on the integer kernels: below this, dequantising the weight costs more
// than the faster products save.
constexpr int64_t kPanelMinRows = 32;
// Register tile: 8 weight rows x 3 blocks of 16 rows of x (24 float32 sums). Eight weight rows
// give each row of x eight neighbouring outputs: one 16-byte bf16 store.
constexpr int kPanelW = 8, kPanelX = 3;

// Weight row ``col`` as bf16: scale * code - offset per group (float32, one rounding to bf16).
template <int B, int G>
void dequant_row_bf16(const QuantWeight& w, int64_t col, float* s, float* o, uint16_t* dst) {
  constexpr int V = G / 16;
  expand_scales(w, col, s, o);
  const uint8_t* codes = w.codes + col * w.row_bytes;
  const int64_t group_bytes = G * B / 8;
  for (int64_t g = 0; g < w.num_groups; ++g) {
    __m512 q[V];
    unpack_group<B, G>(codes + g * group_bytes, q);
    const __m512 scale = _mm512_set1_ps(s[g]);
    const __m512 offset = _mm512_set1_ps(w.group_offset ? o[g] : 0.0f);
    for (int v = 0; v < V; ++v) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_fmsub_ps(scale, q[v], offset));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + g * G + v * 16), (__m256i)h);
    }
  }
}

// sums[c][v * 16 + i] = weight row c (bf16, row stride k) . row i of x's packed block v. The
// sums stay in registers until the end (an array the caller passes in would live in memory).
template <int NV>
inline void panel_tile(const uint16_t* rows, int64_t k, const __m512bh* xb, int64_t kp,
                       float sums[kPanelW][kPanelX * 16]) {
  __m512 acc[kPanelW][NV];
  for (int c = 0; c < kPanelW; ++c)
    for (int v = 0; v < NV; ++v) acc[c][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512bh xv[NV];
    for (int v = 0; v < NV; ++v) xv[v] = xb[v * kp + p];
    for (int c = 0; c < kPanelW; ++c) {
      int32_t pair;
      std::memcpy(&pair, rows + c * k + 2 * p, sizeof(pair));
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[c][v] = _mm512_dpbf16_ps(acc[c][v], wv, xv[v]);
    }
  }
  for (int c = 0; c < kPanelW; ++c)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(sums[c] + v * 16, acc[c][v]);
}

template <typename Fn>
inline bool with_panel_layout(const QuantWeight& w, Fn&& fn) {
  if (w.k % 32 != 0) return false;
  if (w.bits == 4 && w.group == 32) return fn(Const<4>{}, Const<32>{}), true;
  if (w.bits == 8 && w.group == 32) return fn(Const<8>{}, Const<32>{}), true;
  if (w.bits == 8 && w.group == 16) return fn(Const<8>{}, Const<16>{}), true;
  return false;
}

inline bool takes_panels(const at::Tensor& x, const QuantWeight& w) {
  return x.scalar_type() == at::kBFloat16 && x.size(0) >= kPanelMinRows &&
         with_panel_layout(w, [](auto, auto) {});
}

// Output rows (of x) [row0, row0 + count) against weight rows [col0, col0 + cols): the bias
// added, rounded to bf16 eight at a time.
inline void put_panel(const QuantOut& sink, const float sums[kPanelW][kPanelX * 16],
                      int64_t count, int64_t row0, int64_t col0, int64_t cols) {
  alignas(32) float bias[kPanelW] = {};
  for (int c = 0; c < cols; ++c) bias[c] = sink.bias ? sink.bias[col0 + c] : 0.0f;
  const __m256 b = _mm256_load_ps(bias);
  for (int64_t i = 0; i < count; ++i) {
    alignas(32) float y[kPanelW];
    for (int c = 0; c < kPanelW; ++c) y[c] = sums[c][i];
    const __m128bh h = _mm256_cvtneps_pbh(_mm256_add_ps(_mm256_load_ps(y), b));
    uint16_t* dst = reinterpret_cast<uint16_t*>(sink.bf16) + (row0 + i) * sink.n + col0;
    if (cols == kPanelW) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), (__m128i)h);
    } else {
      alignas(16) uint16_t part[kPanelW];
      _mm_store_si128(reinterpret_cast<__m128i*>(part), (__m128i)h);
      std::memcpy(dst, part, cols * sizeof(uint16_t));
    }
  }
}

// y = x . W^T (+ bias) for bf16 x of kPanelMinRows rows or more; the caller checked
// takes_panels(x, w).
at::Tensor quant_linear_panels(const at::Tensor& x, const QuantWeight& w,
                               const c10::optional<at::Tensor>& bias) {
  const int64_t m = x.size(0), n = w.n, k = w.k;
  auto out = at::empty({m, n}, x.options());
  const at::Tensor bias_f = float_bias(bias, n);
  const QuantOut sink = sink_of(out, bias_f);
  const at::Tensor packed_x = pack_bf16_weight(x.contiguous());  // [M/16, K/2, 16, 2]
  const int64_t num_blocks = packed_x.size(0), kp = packed_x.size(1);
  const auto* xb = reinterpret_cast<const __m512bh*>(packed_x.data_ptr<at::BFloat16>());
  with_panel_layout(w, [&](auto b, auto g) {
    constexpr int B = decltype(b)::value, G = decltype(g)::value;
    at::parallel_for(0, (n + kPanelW - 1) / kPanelW, 1, [&](int64_t t0, int64_t t1) {
      std::vector<uint16_t> rows(kPanelW * k, 0);
      std::vector<float> s(w.num_groups), o(w.num_groups);
      float sums[kPanelW][kPanelX * 16];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t col0 = t * kPanelW, cols = std::min<int64_t>(kPanelW, n - col0);
        for (int64_t c = 0; c < cols; ++c)
          dequant_row_bf16<B, G>(w, col0 + c, s.data(), o.data(), rows.data() + c * k);
        if (cols < kPanelW) std::fill(rows.begin() + cols * k, rows.end(), 0);
        for (int64_t v0 = 0, nv = 0; v0 < num_blocks; v0 += nv) {
          // Never a lone block at the end (3 + 1 -> 2 + 2): a tile of one block is bound by
          // its weight broadcasts (64 rows of Q8_0 ran at 224-241 GMAC/s, 32 rows at 381-400).
          const int64_t left = num_blocks - v0;
          nv = left >= 4 && left % kPanelX == 1 ? 2 : std::min<int64_t>(kPanelX, left);
          const __m512bh* block = xb + v0 * kp;
          switch (nv) {
            case 3: panel_tile<3>(rows.data(), k, block, kp, sums); break;
            case 2: panel_tile<2>(rows.data(), k, block, kp, sums); break;
            default: panel_tile<1>(rows.data(), k, block, kp, sums); break;
          }
          const int64_t row0 = v0 * 16;
          put_panel(sink, sums, std::min<int64_t>(nv * 16, m - row0), row0, col0, cols);
        }
      }
    });
  });
  return out;
}
#endif

}  // namespace
