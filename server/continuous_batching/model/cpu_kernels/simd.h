// The vector operations the kernels are written in, one struct per ISA level, so that each
// kernel has one body for AVX-512 (16 float lanes) and AVX2 (8 lanes). A build defines
// ``Simd`` as the widest its flags allow (-mavx512f...: Simd512; -mavx2 -mfma -mf16c:
// Simd256); without either, LLM_SUITE_HAS_SIMD is not defined and only the scalar loops exist.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LLM_SUITE_HAS_SIMD 1
struct Simd512 {
  using F = __m512;
  using I = __m512i;
  static constexpr int W = 16;
  //: Value accumulators kept per pass of decode attention (query heads x vectors of a head).
  static constexpr int kValueRows = 4, kValueSlice = 8;
  //: bf16 matmul register tile (rows x blocks of W columns), and blocks per column group.
  static constexpr int kTileRows = 4, kTileBlocks = 4, kGroupBlocks = 4;

  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const c10::BFloat16* p) {  // widen: a 16-bit shift into the high half
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static I load_bits(const void* p) { return _mm512_loadu_si512(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F neg_abs(F x) {  // -|x|: the sign bit set
    return _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int32_t(0x80000000u))));
  }
  // Per lane, x >= 0 ? a : b (NaN x takes b).
  static F select_nonneg(F x, F a, F b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, zero(), _CMP_GE_OQ), b, a);
  }
  static float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  // Lanes of a greater than b (ordered: NaN never passes), one bit each.
  static uint32_t greater_mask(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static F round_nearest(F x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static F pow2(F n) {  // 2^n for whole n in [-126, 127], built in the exponent bits
    const I e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  // A pair of bf16 rows packed as 32-bit lanes (second << 16 | first) -> the two as floats.
  static F pair_first(I bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)); }
  static F pair_second(I bits) {
    return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
  }
  // Four accumulators -> their four sums in one vector (lane i = sum of x_i's lanes): about a
  // third of the instructions of four separate horizontal reductions.
  static __m128 reduce4(F a, F b, F c, F d) {
    // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then [a, b, c, d] partial sums.
    const F ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const F cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const F t = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), upper);
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  }
  // The first ``count`` lanes rounded to bfloat16 (nearest even; NaN stays NaN) at dst.
  static void store_bf16(uint16_t* dst, F v, int count) {
    const I bits = _mm512_castps_si512(v);
    const I lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    I r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    const __mmask16 mask = count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1u);
    _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(r));
  }
};
using Simd = Simd512;
#elif defined(__AVX2__) && defined(__FMA__)
#define LLM_SUITE_HAS_SIMD 1
struct Simd256 {
  using F = __m256;
  using I = __m256i;
  static constexpr int W = 8;
  // 16 registers: a quarter of AVX-512's register bytes, so smaller tiles. The matmul tile of
  // 5 rows x 2 blocks holds 10 sums, 4 widened weight vectors and a broadcast: 15 registers
  // (measured against 4 rows: 1.05-1.2x at 256 rows; 6 rows spill and run at 0.7x).
  static constexpr int kValueRows = 2, kValueSlice = 4;
  static constexpr int kTileRows = 5, kTileBlocks = 2, kGroupBlocks = 4;

  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static I load_bits(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F neg_abs(F x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.0f)); }
  static F select_nonneg(F x, F a, F b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, zero(), _CMP_GE_OQ));
  }
  static float reduce_add(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float reduce_max(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static uint32_t greater_mask(F a, F b) {
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)));
  }
  static F round_nearest(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {
    const I e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static F pair_first(I bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)); }
  static F pair_second(I bits) {
    return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
  }
  static __m128 reduce4(F a, F b, F c, F d) {
    // [a01 a23 b01 b23 | a45 a67 b45 b67], the same for c, d, then one sum per input per half.
    const F abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  }
  static void store_bf16(uint16_t* dst, F v, int count) {
    const I bits = _mm256_castps_si256(v);
    const I lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    I r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const I nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // Pack the eight 32-bit lanes to 16 bits (per 128-bit half), then gather the halves.
    const __m128i packed = _mm256_castsi256_si128(
        _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
    if (count >= 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
    } else {
      alignas(16) uint16_t tmp[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(tmp), packed);
      std::memcpy(dst, tmp, count * sizeof(uint16_t));
    }
  }
};
using Simd = Simd256;
#endif

#if defined(LLM_SUITE_HAS_SIMD)
// exp(x) of every lane, x <= 0: exp_nonpositive (common.h), lane-wise.
template <class S>
inline typename S::F exp_nonpositive_v(typename S::F x) {
  x = S::max(x, S::set1(-87.0f));
  const auto n = S::round_nearest(S::mul(x, S::set1(1.44269504088896341f)));
  auto r = S::fnmadd(n, S::set1(0.693145751953125f), x);
  r = S::fnmadd(n, S::set1(1.428606765330187e-06f), r);
  auto p = S::set1(1.0f / 5040.0f);
  p = S::fmadd(p, r, S::set1(1.0f / 720.0f));
  p = S::fmadd(p, r, S::set1(1.0f / 120.0f));
  p = S::fmadd(p, r, S::set1(1.0f / 24.0f));
  p = S::fmadd(p, r, S::set1(1.0f / 6.0f));
  p = S::fmadd(p, r, S::set1(0.5f));
  p = S::fmadd(p, r, S::set1(1.0f));
  p = S::fmadd(p, r, S::set1(1.0f));
  return S::mul(p, S::pow2(n));
}

// sigmoid(z) of every lane: sigmoid (common.h), lane-wise.
template <class S>
inline typename S::F sigmoid_v(typename S::F z) {
  const auto e = exp_nonpositive_v<S>(S::neg_abs(z));
  return S::div(S::select_nonneg(z, S::set1(1.0f), e), S::add(S::set1(1.0f), e));
}

// tanh(y) of every lane from exp(-2|y|) only: (1 - e) / (1 + e), y's sign restored (absolute
// error about 1e-7, where libm's scalar tanh cost a call per element).
template <class S>
inline typename S::F tanh_v(typename S::F y) {
  const auto e = exp_nonpositive_v<S>(S::neg_abs(S::add(y, y)));
  const auto one = S::set1(1.0f);
  const auto t = S::div(S::sub(one, e), S::add(one, e));
  return S::select_nonneg(y, t, S::sub(S::zero(), t));
}

// The element types the vector loops load (Simd::load) and store (store_lanes); others take
// the scalar loops.
template <typename T>
constexpr bool kIsSimdIo = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
inline void store_lanes(float* p, Simd::F v) { Simd::store(p, v); }
// Rounded to bf16 as from_f32 rounds (nearest even, NaN stays NaN).
inline void store_lanes(c10::BFloat16* p, Simd::F v) {
  Simd::store_bf16(reinterpret_cast<uint16_t*>(p), v, Simd::W);
}
#endif

}  // namespace
