// The tiled super-block layouts (lane_tiles.h: K-quants, GPTQ g128) on AVX2: each 64-byte
// vector of a tile as two halves of 8 weight rows, one row a 32-bit lane, times 4 codes of a
// row of x broadcast to every lane. AVX2 has no vpdpbusd: vpmaddubsw multiplies the unsigned
// codes by x into int16 pairs, added up in int16 as far as they cannot overflow (8 k-quads of
// 4-bit codes: 8 * 2 * 15 * 127 = 30480; 2 of 6-bit: 2 * 2 * 63 * 127 = 32004, 5-bit likewise), and one
// vpmaddwd by the group's scale, twice in each lane, turns them into the scaled int32 group sum.
// The per-column dot products of qgemm_super.h pay a horizontal sum and a float tail per weight
// row and super-block; here 8 rows share them.
//   y = sum_b d_b dx_b (sum_g sc_g (q_g . xq_g)) - dmin_b dx_b (sum_g m_g sum(xq_g))
// Q6_K's + 32 is taken off as qgemm_lanes.h does. The integer sums are exact (qgemm_super.h's
// bounds): the same value as quant_linear_super, up to float summation order.
#pragma once

#include "lane_tiles.h"

namespace {

#if defined(LLM_SUITE_HAS_QGEMM_LANES) && !defined(LLM_SUITE_SUPER_512)

// Rows of x per pass over a tile. 6 rows' int32 and int16 sums, the codes, scale pairs and a
// broadcast are one register more than the 16; still, Zen 5 forced to AVX2, 2 threads, GMAC/s:
// 4 rows Q4_K 248-256 / Q6_K 198-210, 6 rows 259-270 / 210-226 (the plain layout's dot
// products: 155-171 / 126-142).
constexpr int kLaneBlockRows = 6;
constexpr int kHalfRows = 8;  // weight rows a 256-bit register holds
// Rows of x up to which a pass takes both halves of a tile at once (more would spill the
// sums). Zen 4 forced to AVX2, 2 threads, in-cache GB/s of Q4_K, one pass per half -> both:
// 1 row 60-65 -> 72-80, 2 rows 42-46 -> 50-56; batch-1 step, 1B Q4_K_M 26.0 -> 23.4-24.3 ms,
// 3B 66-69 -> 61-62 ms; Q6_K gains 2-3% (its 6-bit unpacking dominates).
constexpr int kBothHalvesRows = 2;

inline __m256i broadcast_quad256(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// 8 small per-row values (one byte each) as int32 lanes.
template <bool SIGNED>
inline __m256i half_lanes(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return SIGNED ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
}

// Two int32 lane vectors as int16 pairs (lo in the low half of each lane, hi in the high).
inline __m256i int16_pairs(__m256i lo, __m256i hi) {
  const __m256i low = _mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF));
  return _mm256_or_si256(low, _mm256_slli_epi32(hi, 16));
}

// 8 rows' super-block scales (or offsets) from `at`: float32, or fp16 where the weight has
// them so (one branch per super-block, on a flag fixed for the weight).
inline __m256 super_half_lanes(const float* f32, const c10::Half* f16, int64_t at) {
  if (f16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f16 + at)));
  return _mm256_loadu_ps(f32 + at);
}

// The half's next codes of k-quads 0-3 from a 6-bit block (three 64-byte vectors at p).
inline void six_bit_quads256(const uint8_t* p, __m256i v[4]) {
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i n0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i n1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128));
  const auto join = [&](__m256i a, __m256i b) {
    return _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(b, top));
  };
  v[0] = join(n0, _mm256_slli_epi16(h, 4));
  v[1] = join(_mm256_srli_epi16(n0, 4), _mm256_slli_epi16(h, 2));
  v[2] = join(n1, h);
  v[3] = join(_mm256_srli_epi16(n1, 4), _mm256_srli_epi16(h, 2));
}

// The half's next codes of k-quads 0-7 from a 5-bit block (five 64-byte vectors at p): bit q
// of the last vector's bytes is bit 4 of k-quad q (16-bit shifts: no byte takes its
// neighbour's bits).
inline void five_bit_quads256(const uint8_t* p, __m256i v[8]) {
  const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256));
  const __m256i highs[8] = {_mm256_slli_epi16(h, 4), _mm256_slli_epi16(h, 3),
                            _mm256_slli_epi16(h, 2), _mm256_slli_epi16(h, 1),
                            h,                       _mm256_srli_epi16(h, 1),
                            _mm256_srli_epi16(h, 2), _mm256_srli_epi16(h, 3)};
  for (int i = 0; i < 4; ++i) {
    const __m256i n = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * i));
    v[2 * i] = _mm256_or_si256(_mm256_and_si256(n, low), _mm256_and_si256(highs[2 * i], bit4));
    v[2 * i + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n, 4), low),
                                   _mm256_and_si256(highs[2 * i + 1], bit4));
  }
}

// Super-block b of R rows of x (from r0) against H halves (rows 8 half0 ..) of tile t, added
// to out: out[h][r] lane c += x row r0 + r . weight row 16 t + 8 (half0 + h) + c (that part).
// Both halves in one pass (H = 2) share each broadcast of x and the loop's overhead: few rows
// only, as their sums take twice the registers.
template <int B, int G, int S, bool SIGNED, bool OFFSET, int R, int H>
inline void halves_super_block(const QuantWeight& w, const SuperRows& xq, int64_t r0, int64_t t,
                               int64_t b, int half0, __m256 out[H][R]) {
  static_assert(B == 4 || B == 5 || B == 6, "4-, 5- or 6-bit tiles");
  static_assert(H == 1 || H == 2, "one half or both");
  constexpr int kGroupBytes = G * kLaneRows * B / 8;
  // Per unit: k-quads and bytes.
  constexpr int kQuads = B == 4 ? 2 : B == 5 ? 8 : 4, kUnitBytes = B == 4 ? 64 : B == 5 ? 320 : 192;
  static_assert(kGroupBytes % kUnitBytes == 0, "whole units per group");
  const int64_t k = w.k, ng = w.num_groups, ns = w.num_super;
  const uint8_t* codes = w.codes + t * kLaneRows * w.row_bytes;
  const uint8_t* scales = static_cast<const uint8_t*>(w.group_scale) + t * kLaneRows * ng;
  const uint8_t* mins =
      OFFSET ? static_cast<const uint8_t*>(w.group_offset) + t * kLaneRows * ng : nullptr;
  const int8_t* x = xq.codes.data() + r0 * k;
  const int16_t* xsums = xq.sums.data() + r0 * ng;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  {
    __m256i block[H][R];
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < R; ++r) block[h][r] = _mm256_setzero_si256();
    for (int g = 0; g < S; ++g) {
      const int64_t gi = b * S + g;
      const uint8_t* group_codes = codes + gi * kGroupBytes;
      const int8_t* xg = x + gi * G;
      __m256i sc_pairs[H];
      for (int h = 0; h < H; ++h) {
        const __m256i sc = half_lanes<SIGNED>(scales + gi * kLaneRows + (half0 + h) * kHalfRows);
        sc_pairs[h] = int16_pairs(sc, sc);
      }
      __m256i part[H][R];  // int16 sums of 4-bit quads, a whole group (see the bounds above)
      // One unit of the group; the first sets the int16 sums instead of adding to zeros (an
      // add per row and group less: Zen 5 forced to AVX2, 2 threads, Q4_K at 32 rows 261-265
      // -> 283-285 GMAC/s, at 6 rows 230-252 -> 249-272).
      const auto unit_products = [&](int u, auto is_first) {
        const uint8_t* unit = group_codes + u * kUnitBytes;
        for (int line = 0; line < kUnitBytes; line += 64)
          __builtin_prefetch(unit + line + kLanePrefetchBytes, 0, 3);
        __m256i v[H][8];
        for (int h = 0; h < H; ++h) {
          const uint8_t* p = unit + (half0 + h) * 32;
          if constexpr (B == 4) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
            v[h][0] = _mm256_and_si256(raw, mask);
            v[h][1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
          } else if constexpr (B == 5) {
            five_bit_quads256(p, v[h]);
          } else {
            six_bit_quads256(p, v[h]);
          }
        }
        const int8_t* xu = xg + u * kQuads * 4;
        for (int r = 0; r < R; ++r)
          for (int q = 0; q < kQuads; q += 2) {
            const __m256i x0 = broadcast_quad256(xu + r * k + 4 * q);
            const __m256i x1 = broadcast_quad256(xu + r * k + 4 * q + 4);
            for (int h = 0; h < H; ++h) {
              const __m256i two = _mm256_add_epi16(_mm256_maddubs_epi16(v[h][q], x0),
                                                   _mm256_maddubs_epi16(v[h][q + 1], x1));
              if constexpr (B != 4)
                block[h][r] = _mm256_add_epi32(block[h][r], _mm256_madd_epi16(two, sc_pairs[h]));
              else if constexpr (decltype(is_first)::value)
                part[h][r] = two;
              else
                part[h][r] = _mm256_add_epi16(part[h][r], two);
            }
          }
      };
      unit_products(0, std::true_type{});
// Not unrolled: unrolled, g++ hoisted every product of the group and kept them on the stack
// (Q4_K at 6 rows: 192-200 GMAC/s).
#pragma GCC unroll 1
      for (int u = 1; u < kGroupBytes / kUnitBytes; ++u) unit_products(u, std::false_type{});
      if constexpr (B == 4)
        for (int h = 0; h < H; ++h)
          for (int r = 0; r < R; ++r)
            block[h][r] = _mm256_add_epi32(block[h][r], _mm256_madd_epi16(part[h][r], sc_pairs[h]));
    }
    // Per row, the offsets' integer sums and Q6_K's + 32, pairs of groups a vpmaddwd.
    __m256i offsets[H][R];
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < R; ++r) offsets[h][r] = _mm256_setzero_si256();
    for (int j = 0; j < S / 2; ++j) {
      const int64_t g0 = b * S + 2 * j;
      for (int h = 0; h < H; ++h) {
        const int64_t at = g0 * kLaneRows + (half0 + h) * kHalfRows;
        __m256i min_pairs = _mm256_setzero_si256(), bias_pairs = _mm256_setzero_si256();
        if constexpr (OFFSET) min_pairs = int16_pairs(half_lanes<false>(mins + at),
                                                      half_lanes<false>(mins + at + kLaneRows));
        if constexpr (SIGNED)
          bias_pairs = int16_pairs(_mm256_slli_epi32(half_lanes<true>(scales + at), 5),
                                   _mm256_slli_epi32(half_lanes<true>(scales + at + kLaneRows), 5));
        for (int r = 0; r < R; ++r) {
          int32_t both;
          std::memcpy(&both, xsums + r * ng + g0, sizeof(both));
          const __m256i xs = _mm256_set1_epi32(both);
          if constexpr (OFFSET)
            offsets[h][r] = _mm256_add_epi32(offsets[h][r], _mm256_madd_epi16(min_pairs, xs));
          if constexpr (SIGNED)
            block[h][r] = _mm256_sub_epi32(block[h][r], _mm256_madd_epi16(bias_pairs, xs));
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const int64_t lanes = t * kLaneRows * ns + b * kLaneRows + (half0 + h) * kHalfRows;
      const __m256 dv = super_half_lanes(w.super_scale, w.super_scale_half, lanes);
      const __m256 dminv = OFFSET ? super_half_lanes(w.super_offset, w.super_offset_half, lanes)
                                  : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(xq.scale[(r0 + r) * ns + b]);
        const __m256 scale = _mm256_mul_ps(dv, dx);
        out[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block[h][r]), scale, out[h][r]);
        if constexpr (OFFSET) {
          const __m256 offset_scale = _mm256_mul_ps(dminv, dx);
          out[h][r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(offsets[h][r]), offset_scale, out[h][r]);
        }
      }
    }
  }
}

// 8 float32 outputs of one row at column col0, bias added, in the call's dtype.
inline void put_half(__m256 y, int64_t row, int64_t col0, const QuantOut& sink) {
  if (sink.bias) y = _mm256_add_ps(y, _mm256_loadu_ps(sink.bias + col0));
  if (sink.bf16)
    Simd256::store_bf16(reinterpret_cast<uint16_t*>(sink.bf16 + row * sink.n + col0), y, 8);
  else
    _mm256_storeu_ps(sink.f32 + row * sink.n + col0, y);
}

// R rows of x (from r0) against tile t, super-block by super-block: both halves of each
// before the next (together for few rows), so a tile's codes stream from memory once, without
// a pause while a second pass reads them from L2 (batch 1, 1B Q4_K_M: 45.7 GB/s with a pass
// per half of the whole tile against 55.6 for the plain layout).
template <int B, int G, int S, bool SIGNED, bool OFFSET, int R>
void lanes_rows(const QuantWeight& w, const SuperRows& xq, int64_t r0, int64_t t,
                const QuantOut& sink) {
  constexpr int H = R <= kBothHalvesRows ? 2 : 1;
  __m256 y[2][R];
  for (int half = 0; half < 2; ++half)
    for (int r = 0; r < R; ++r) y[half][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.num_super; ++b)
    for (int half = 0; half < 2; half += H)
      halves_super_block<B, G, S, SIGNED, OFFSET, R, H>(w, xq, r0, t, b, half, &y[half]);
  for (int half = 0; half < 2; ++half)
    for (int r = 0; r < R; ++r)
      put_half(y[half][r], r0 + r, t * kLaneRows + half * kHalfRows, sink);
}

#endif

}  // namespace
