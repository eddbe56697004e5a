// The super-block layouts (K-quants, GPTQ g128) on AVX512-VNNI with the weight's rows in the
// lanes: tiles of 16 weight rows are stored interleaved at load (``lane_tile_codes``), so one
// 64-byte load is 16 rows' next codes, and each vpdpbusd multiplies them by 4 codes of one row
// of x broadcast to every lane. No per-call unpacking into panels, no horizontal sums: 4-bit
// codes take an and and a shift per 128 codes, and a row's 16 outputs are one store.
//
// The tiled layout is lane_tiles.h's.
// vpdpbusd takes unsigned weight bytes times signed x. Q6_K's + 32 adds 32 sum_g sc_g sum(xq_g),
// taken off per super-block as the offsets' sums are (pairs of groups a vpdpwssd, from x's
// group sums):
//   y = sum_b d_b dx_b (sum_g sc_g (q_g . xq_g)) - dmin_b dx_b (sum_g m_g sum(xq_g))
// The integer sums are qgemm_super.h's (its bounds hold): the same value as quant_linear_super,
// up to float summation order.
#pragma once

#include "lane_tiles.h"
#include "qgemm_lanes_avx2.h"

namespace {

#if defined(LLM_SUITE_HAS_QGEMM_LANES) && defined(LLM_SUITE_SUPER_512)

constexpr int kLaneBlockRows = 8;  // rows of x per pass over a tile (3 x 8 accumulators)
// acc + v . the four codes of x's row at p (broadcast to every lane): one vpdpbusd with an
// embedded broadcast, which g++ does not fold from _mm512_set1_epi32 by itself (it issued a
// vpbroadcastd per product). Zen 4, 2 threads, 3B Q4_K_M: Q4_K at 128 rows 339-344 -> 348-352
// GMAC/s, at 2 rows (batch-1 shapes in cache) 63-77 -> 73-81 GB/s; a 128-token prefill
// 1188-1211 -> 1160 ms.
inline __m512i dpbusd_broadcast(__m512i acc, __m512i v, const int8_t* p) {
  using Quad = int32_t __attribute__((may_alias));  // x's codes are int8: read as one word
  __asm__("vpdpbusd %2%{1to16%}, %1, %0"
          : "+v"(acc)
          : "v"(v), "m"(*reinterpret_cast<const Quad*>(p)));
  return acc;
}

// 16 small scales (one per row of the tile) as int32 lanes.
template <bool SIGNED>
inline __m512i lane_scales(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return SIGNED ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
}

// Two groups' per-row multipliers as int16 pairs (group 2j low, 2j + 1 high), times 2^SHIFT.
template <bool SIGNED, int SHIFT>
inline __m512i lane_pairs(const uint8_t* first) {
  const __m512i lo = _mm512_slli_epi32(lane_scales<SIGNED>(first), SHIFT);
  const __m512i hi = _mm512_slli_epi32(lane_scales<SIGNED>(first + kLaneRows), 16 + SHIFT);
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)), hi);
}

// 16 rows' super-block scales (or offsets) from `at`: float32, or fp16 where the weight has
// them so (one branch per super-block, on a flag fixed for the weight).
inline __m512 super_lanes(const float* f32, const c10::Half* f16, int64_t at) {
  if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f16 + at)));
  return _mm512_loadu_ps(f32 + at);
}

// R rows of x (from r0) against tile t's 16 weight rows: total[r] lane c = x row r0 + r . row
// 16 t + c. Groups of 32 4-bit codes are 4 loads, of 8-bit codes G / 4 loads; with few rows the
// loads alternate between two sets of accumulators (a chain of dependent vpdpbusd otherwise).
// The 16 rows' next 4 codes of each of four k-quads from a 6-bit block (192 bytes).
inline void six_bit_quads(const uint8_t* p, __m512i v[4]) {
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  const __m512i n0 = _mm512_loadu_si512(p), n1 = _mm512_loadu_si512(p + 64);
  const __m512i h = _mm512_loadu_si512(p + 128);
  // (a & low) | (b & top), b's bits 4-5 already in place: one vpternlogd each.
  const auto join = [&](__m512i a, __m512i b) {
    return _mm512_ternarylogic_epi32(_mm512_and_si512(a, low), b, top, 0xF8);
  };
  v[0] = join(n0, _mm512_slli_epi16(h, 4));
  v[1] = join(_mm512_srli_epi16(n0, 4), _mm512_slli_epi16(h, 2));
  v[2] = join(n1, h);
  v[3] = join(_mm512_srli_epi16(n1, 4), _mm512_srli_epi16(h, 2));
}

// h's bits at bit Q of each byte moved to bit 4 (16-bit shifts: no byte takes its
// neighbour's bits, Q <= 7).
template <int Q>
inline __m512i bit_q_at_4(__m512i h) {
  if constexpr (Q < 4) return _mm512_slli_epi16(h, 4 - Q);
  else if constexpr (Q > 4) return _mm512_srli_epi16(h, Q - 4);
  else return h;
}

// The 16 rows' next 4 codes of each of eight k-quads from a 5-bit block (320 bytes).
inline void five_bit_quads(const uint8_t* p, __m512i v[8]) {
  const __m512i low = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  const __m512i h = _mm512_loadu_si512(p + 256);
  const auto join = [&](__m512i a, __m512i b) {  // (a & low) | (b & bit4)
    return _mm512_ternarylogic_epi32(_mm512_and_si512(a, low), b, bit4, 0xF8);
  };
  const __m512i n0 = _mm512_loadu_si512(p), n1 = _mm512_loadu_si512(p + 64);
  const __m512i n2 = _mm512_loadu_si512(p + 128), n3 = _mm512_loadu_si512(p + 192);
  v[0] = join(n0, bit_q_at_4<0>(h));
  v[1] = join(_mm512_srli_epi16(n0, 4), bit_q_at_4<1>(h));
  v[2] = join(n1, bit_q_at_4<2>(h));
  v[3] = join(_mm512_srli_epi16(n1, 4), bit_q_at_4<3>(h));
  v[4] = join(n2, bit_q_at_4<4>(h));
  v[5] = join(_mm512_srli_epi16(n2, 4), bit_q_at_4<5>(h));
  v[6] = join(n3, bit_q_at_4<6>(h));
  v[7] = join(_mm512_srli_epi16(n3, 4), bit_q_at_4<7>(h));
}

// R rows of x (from r0) against tile t's 16 weight rows: total[r] lane c = x row r0 + r . row
// 16 t + c. A group's codes are G / 8 loads (4-bit), G / 16 blocks of three (6-bit) or G / 32
// blocks of five (5-bit); with few rows the k-quads alternate between two sets of accumulators
// (a chain of dependent vpdpbusd otherwise).
template <int B, int G, int S, bool SIGNED, bool OFFSET, int R>
void lanes_block(const QuantWeight& w, const SuperRows& xq, int64_t r0, int64_t t,
                 __m512 total[R]) {
  static_assert(B == 4 || B == 5 || B == 6, "4-, 5- or 6-bit tiles");
  constexpr int kGroupBytes = G * kLaneRows * B / 8;
  // Per unit: k-quads and bytes.
  constexpr int kQuads = B == 4 ? 2 : B == 5 ? 8 : 4, kUnitBytes = B == 4 ? 64 : B == 5 ? 320 : 192;
  static_assert(kGroupBytes % kUnitBytes == 0, "whole units per group");
  constexpr int A = R <= 2 ? 2 : 1;  // accumulator sets
  const int64_t k = w.k, ng = w.num_groups, ns = w.num_super;
  const uint8_t* codes = w.codes + t * kLaneRows * w.row_bytes;
  const uint8_t* scales = static_cast<const uint8_t*>(w.group_scale) + t * kLaneRows * ng;
  const uint8_t* mins =
      OFFSET ? static_cast<const uint8_t*>(w.group_offset) + t * kLaneRows * ng : nullptr;
  const int64_t super_at = t * kLaneRows * ns;  // the tile's super scales and offsets
  const int8_t* x = xq.codes.data() + r0 * k;
  const int16_t* xsums = xq.sums.data() + r0 * ng;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < ns; ++b) {
    __m512i block[R];
    for (int r = 0; r < R; ++r) block[r] = _mm512_setzero_si512();
    for (int g = 0; g < S; ++g) {
      const int64_t gi = b * S + g;
      const uint8_t* group_codes = codes + gi * kGroupBytes;
      const int8_t* xg = x + gi * G;
      __m512i acc[A][R];
      for (int a = 0; a < A; ++a)
        for (int r = 0; r < R; ++r) acc[a][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int u = 0; u < kGroupBytes / kUnitBytes; ++u) {
        const uint8_t* unit = group_codes + u * kUnitBytes;
        for (int line = 0; line < kUnitBytes; line += 64)
          __builtin_prefetch(unit + line + kLanePrefetchBytes, 0, 3);
        __m512i v[8];
        if constexpr (B == 4) {
          const __m512i raw = _mm512_loadu_si512(unit);
          v[0] = _mm512_and_si512(raw, mask);
          v[1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        } else if constexpr (B == 5) {
          five_bit_quads(unit, v);
        } else {
          six_bit_quads(unit, v);
        }
        const int8_t* xu = xg + u * kQuads * 4;
        for (int r = 0; r < R; ++r)
          for (int q = 0; q < kQuads; ++q)
            acc[q % A][r] = dpbusd_broadcast(acc[q % A][r], v[q], xu + r * k + 4 * q);
      }
      const __m512i sc = lane_scales<SIGNED>(scales + gi * kLaneRows);
      for (int r = 0; r < R; ++r) {
        const __m512i sum = A == 2 ? _mm512_add_epi32(acc[0][r], acc[A - 1][r]) : acc[0][r];
        block[r] = _mm512_add_epi32(block[r], _mm512_mullo_epi32(sum, sc));
      }
    }
    // Per row, the offsets' integer sums and Q6_K's + 32 (32 sum_g sc_g sum(xq_g), taken off
    // the group sums exactly in int32), pairs of groups a vpdpwssd.
    __m512i offsets[R];
    for (int r = 0; r < R; ++r) offsets[r] = _mm512_setzero_si512();
    for (int j = 0; j < S / 2; ++j) {
      const int64_t g0 = b * S + 2 * j;
      __m512i min_pairs = _mm512_setzero_si512(), bias_pairs = _mm512_setzero_si512();
      if constexpr (OFFSET) min_pairs = lane_pairs<false, 0>(mins + g0 * kLaneRows);
      if constexpr (SIGNED) bias_pairs = lane_pairs<SIGNED, 5>(scales + g0 * kLaneRows);
      for (int r = 0; r < R; ++r) {
        int32_t both;
        std::memcpy(&both, xsums + r * ng + g0, sizeof(both));
        const __m512i xs = _mm512_set1_epi32(both);
        if constexpr (OFFSET) offsets[r] = _mm512_dpwssd_epi32(offsets[r], min_pairs, xs);
        if constexpr (SIGNED)
          block[r] = _mm512_sub_epi32(block[r], _mm512_madd_epi16(bias_pairs, xs));
      }
    }
    const int64_t lanes = super_at + b * kLaneRows;
    const __m512 dv = super_lanes(w.super_scale, w.super_scale_half, lanes);
    const __m512 dminv =
        OFFSET ? super_lanes(w.super_offset, w.super_offset_half, lanes) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(xq.scale[(r0 + r) * ns + b]);
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block[r]), _mm512_mul_ps(dv, dx), total[r]);
      if constexpr (OFFSET)
        total[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(offsets[r]), _mm512_mul_ps(dminv, dx),
                                    total[r]);
    }
  }
}

// 16 float32 outputs of one row, bias added, stored in the call's dtype (bf16: nearest even).
inline void put_lanes(__m512 y, int64_t row, int64_t col0, const QuantOut& sink) {
  if (sink.bias) y = _mm512_add_ps(y, _mm512_loadu_ps(sink.bias + col0));
  if (!sink.bf16) {
    _mm512_storeu_ps(sink.f32 + row * sink.n + col0, y);
    return;
  }
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sink.bf16 + row * sink.n + col0),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

template <int B, int G, int S, bool SIGNED, bool OFFSET, int R>
void lanes_rows(const QuantWeight& w, const SuperRows& xq, int64_t r0, int64_t t,
                const QuantOut& sink) {
  __m512 total[R];
  lanes_block<B, G, S, SIGNED, OFFSET, R>(w, xq, r0, t, total);
  for (int r = 0; r < R; ++r) put_lanes(total[r], r0 + r, t * kLaneRows, sink);
}

#endif

#if defined(LLM_SUITE_HAS_QGEMM_LANES)
// Rows [r0, r0 + num_rows) (1 <= num_rows <= R) against tile t, with the build's lanes_rows
// (qgemm_lanes.h or qgemm_lanes_avx2.h) compiled for that many rows.
template <int B, int G, int S, bool SIGNED, bool OFFSET, int R = kLaneBlockRows>
void lanes_pass(const QuantWeight& w, const SuperRows& xq, int64_t r0, int64_t num_rows,
                int64_t t, const QuantOut& sink) {
  if constexpr (R > 1) {
    if (num_rows < R)
      return lanes_pass<B, G, S, SIGNED, OFFSET, R - 1>(w, xq, r0, num_rows, t, sink);
  }
  lanes_rows<B, G, S, SIGNED, OFFSET, R>(w, xq, r0, t, sink);
}

// y = x . W^T (+ bias) with W in the tiled layout and x quantised per super-block.
at::Tensor quant_linear_lanes(const at::Tensor& x, const QuantWeight& w,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(with_lane_layout(w, [](auto, auto, auto, auto, auto) {}) && w.n % kLaneRows == 0,
              "tiled weights: a super-block layout and rows in whole tiles of 16");
  const QuantCall call = begin_quant_call(x, w, bias);
  if (call.is_empty()) return call.out;
  const int64_t m = call.m, num_tiles = w.n / kLaneRows;
  with_lane_layout(w, [&](auto b, auto g, auto s, auto is_signed, auto is_offset) {
    constexpr int B = decltype(b)::value, G = decltype(g)::value, S = decltype(s)::value;
    constexpr bool SIGNED = decltype(is_signed)::value, OFFSET = decltype(is_offset)::value;
    const SuperRows& xq = quantize_super(call.x, G * S, G, false);
    const int64_t chunk = std::max<int64_t>(1, kLaneChunkBytes / (kLaneRows * w.row_bytes));
    at::parallel_for(0, num_tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t c0 = t0; c0 < t1; c0 += chunk)
        for (int64_t r = 0; r < m; r += kLaneBlockRows) {
          const int64_t num_rows = std::min<int64_t>(kLaneBlockRows, m - r);
          for (int64_t t = c0; t < std::min(t1, c0 + chunk); ++t)
            lanes_pass<B, G, S, SIGNED, OFFSET>(w, xq, r, num_rows, t, call.sink);
        }
    });
  });
  return call.out;
}
#endif

}  // namespace
