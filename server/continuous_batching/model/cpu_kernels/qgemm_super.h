// The int8-activation matmul (qgemm_i8.h) for weights whose group scales are small integers
// under a float32 super-block scale: GGUF's K-quants (Q4_K, Q5_K, Q6_K) and GPTQ g128, as
// llama.cpp runs them against its Q8_K activations. x is quantised once per super-block of
// L = G * S weights (one float scale per L, not per G), so a whole super-block's dot product is
// integer work: per 32 bytes of codes, _mm256_maddubs_epi16 of codes and x, then
// _mm256_madd_epi16 with the groups' integer scales, added up in int32; one float multiply-add
// per super-block with d * dx. The offsets meet integer per-group sums of x's codes, one
// _mm_madd_epi16 per super-block:
//   y = sum_b d_b dx_b (sum_g sc_g (q_g . xq_g)) - dmin_b dx_b (sum_g m_g sum(xq_g))
// Exactly the float matmul of the dequantised weight with the dequantised x (the reference,
// ``PackedLinear.reference``, quantises x per ``PackedWeight.activation_group``), up to float
// summation order: the integer sums are exact (bounds below).
//
// Against the per-group kernel of qgemm_i8.h this drops the per-row pass that widened every
// group's scale to float (a sixth of a Q4_K_M decode step), two int->float conversions and two
// multiply-adds per 64 weights, and (4-bit codes) the lane permutes: x's codes are stored in
// the order the nibbles come out of a 32-byte load instead.
#pragma once

#include "qgemm.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__)
#define LLM_SUITE_HAS_QGEMM_SUPER 1
#if defined(__AVX512BW__)
// AVX-512 builds take two 32-byte units per instruction (super_block_512).
#define LLM_SUITE_SUPER_512 1
#endif

inline float hsum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// x [M, K] quantised per super-block of L values (L = 128 or 256): codes [M, K] (4-bit
// weights: each run of 64 stored as a0-15 b0-15 a16-31 b16-31 for its two groups a and b of
// 32, the order of a 32-byte load's low then high nibbles), scales [M, K/L], and the integer
// sum of each weight group's codes [M, K/G] (|sum| <= 32 * 127 fits int16).
struct SuperRows {
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<int16_t> sums;
};

// Simd::W codes of v (whole numbers in [-127, 127]) as int8 at dst.
inline void store_codes(int8_t* dst, Simd::F v) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
#else
  const __m256i i32 = _mm256_cvtps_epi32(v);
  const __m128i i16 =
      _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packs_epi16(i16, i16));
#endif
}

// One super-block of ``span`` values (a multiple of Simd::W) from xs: codes
// round(x * 127 / max|x|) (half to even, as torch.round), group sums, and the scale max|x| / 127.
template <typename T>
inline float quantize_span(const T* xs, int64_t span, int64_t group, int8_t* codes,
                           int16_t* sums) {
  using S = Simd;
  S::F peak = S::zero();
  for (int64_t i = 0; i < span; i += S::W) {
    const S::F v = S::load(xs + i);
    peak = S::max(peak, S::max(v, S::sub(S::zero(), v)));
  }
  const float amax = S::reduce_max(peak);
  const S::F inv = S::set1(amax > 0.0f ? 127.0f / amax : 0.0f);
  const S::F hi = S::set1(127.0f), lo = S::set1(-127.0f);
  for (int64_t g = 0; g < span; g += group) {
    S::F total = S::zero();  // whole numbers: exact in float32
    for (int64_t i = g; i < g + group; i += S::W) {
      S::F q = S::round_nearest(S::mul(S::load(xs + i), inv));
      q = S::max(lo, S::min(hi, q));
      store_codes(codes + i, q);
      total = S::add(total, q);
    }
    sums[g / group] = static_cast<int16_t>(S::reduce_add(total));
  }
  return amax / 127.0f;
}

// x [M, K] (float32 or bf16, contiguous) quantised per super-block of ``span`` into this
// thread's reused buffers (a prefill's codes are megabytes: allocating them per call cost a
// page fault per 4 KB), valid until the thread's next call.
inline const SuperRows& quantize_super(const at::Tensor& x, int64_t span, int64_t group,
                                       bool is_nibble_order) {
  thread_local SuperRows buffers;
  SuperRows& q = buffers;  // a name the workers share (the thread_local would be their own)
  const int64_t m = x.size(0), k = x.size(1), num_spans = k / span, groups_per_span = span / group;
  q.codes.resize(m * k);
  q.scale.resize(m * num_spans);
  q.sums.resize(m * k / group);
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const void* data = x.data_ptr();
  at::parallel_for(0, m * num_spans, 16, [&](int64_t b0, int64_t b1) {
    alignas(64) int8_t codes[256];
    for (int64_t b = b0; b < b1; ++b) {
      int8_t* out = q.codes.data() + b * span;
      int8_t* dst = is_nibble_order ? codes : out;
      int16_t* sums = q.sums.data() + b * groups_per_span;
      const int64_t at = b * span;
      q.scale[b] = is_bf16
          ? quantize_span(static_cast<const c10::BFloat16*>(data) + at, span, group, dst, sums)
          : quantize_span(static_cast<const float*>(data) + at, span, group, dst, sums);
      if (!is_nibble_order) continue;
      for (int64_t i = 0; i < span; i += 64) {
        std::memcpy(out + i, codes + i, 16);
        std::memcpy(out + i + 16, codes + i + 32, 16);
        std::memcpy(out + i + 32, codes + i + 16, 16);
        std::memcpy(out + i + 48, codes + i + 48, 16);
      }
#if defined(LLM_SUITE_SUPER_512)
      // Two units per 64-byte load: per 128 codes, both units' low-nibble halves, then both
      // high-nibble halves (units u and u + 1 are 64 codes apart in the order above).
      for (int64_t i = 0; i < span; i += 128) {
        int8_t run[128];
        std::memcpy(run, out + i, 128);
        std::memcpy(out + i + 32, run + 64, 32);
        std::memcpy(out + i + 64, run + 32, 32);
      }
#endif
    }
  });
  return q;
}

// pshufb controls that spread int16 scales over a 32-byte unit's lanes: the low 128 bits all
// scale i, the high ones all scale j (the source holds eight int16 scales in both halves).
// Entries 0-3: the pairs (0,1), (2,3), (4,5), (6,7); entries 4-11: (i, i).
struct ScaleSpread {
  alignas(32) int8_t control[12][32];
  ScaleSpread() {
    for (int e = 0; e < 12; ++e) {
      const int i = e < 4 ? 2 * e : e - 4, j = e < 4 ? 2 * e + 1 : e - 4;
      for (int b = 0; b < 16; ++b) {
        control[e][b] = static_cast<int8_t>(2 * i + (b & 1));
        control[e][16 + b] = static_cast<int8_t>(2 * j + (b & 1));
      }
    }
  }
};
const ScaleSpread kScaleSpread;

// Up to eight 8-bit scales from p as int16, in both 128-bit halves.
template <bool SIGNED, int COUNT>
inline __m256i widen_scales(const uint8_t* p) {
  int64_t raw = 0;
  std::memcpy(&raw, p, COUNT);  // COUNT <= 8: never past the row's last super-block
  const __m128i bytes = _mm_cvtsi64_si128(raw);
  const __m128i wide = SIGNED ? _mm_cvtepi8_epi16(bytes) : _mm_cvtepu8_epi16(bytes);
  return _mm256_broadcastsi128_si256(wide);
}

// The layouts this kernel takes: B-bit codes in groups of G, S groups a super-block.
// Integer bounds per int32 lane and super-block (|scale| <= 255): 4-bit, two maddubs sums
// <= 2 * 2 * 15 * 127 = 7620, times 2 * 255, four units: 15.5M; 8-bit, one maddubs sum
// <= 2 * 128 * 127 = 32512 (saturation-free), times 2 * 255, eight units: 133M < 2^31.
template <int B, int G, int S>
struct SuperLayout {
  static constexpr int kSpan = G * S;                      // L, x's quantisation block
  static constexpr int kUnits = kSpan * B / 8 / 32;        // 32-byte units of codes per block
  static constexpr int kUnitValues = 256 / B;              // weights per unit (64 or 32)
  static constexpr int kHalves = (S + 7) / 8;              // int16 scale vectors per block
  static constexpr int kPerHalf = S < 8 ? S : 8;
  // The scale vector of unit u: which half, and which spread (see ScaleSpread).
  static constexpr int first_group(int u) { return B == 4 || G == 16 ? 2 * u : u; }
  static constexpr int half(int u) { return first_group(u) / 8; }
  static constexpr int spread(int u) {
    return B == 4 || G == 16 ? (first_group(u) % 8) / 2 : 4 + first_group(u) % 8;
  }
  static_assert(kSpan == 128 || kSpan == 256, "super-blocks of 128 or 256 weights");
  static_assert(B == 8 || G == 32, "4-bit codes come in groups of 32");
};

// One super-block's group mins (offset layouts), widened to int16.
template <class Lay>
inline void widen_mins(const uint8_t* mins, __m128i* m16) {
  for (int h = 0; h < Lay::kHalves; ++h)
    m16[h] = _mm256_castsi256_si128(widen_scales<false, Lay::kPerHalf>(mins + h * 8));
}

// sum_g m_g * sum(xq_g) over one super-block of one row of x, exact in int32, as float lanes.
template <class Lay>
inline __m128 offset_sums(const __m128i* m16, const int16_t* sums) {
  __m128i prod = _mm_setzero_si128();
  for (int h = 0; h < Lay::kHalves; ++h) {
    const __m128i s16 = Lay::kPerHalf == 8
        ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(sums + h * 8))
        : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sums + h * 8));
    prod = _mm_add_epi32(prod, _mm_madd_epi16(m16[h], s16));
  }
  return _mm_cvtepi32_ps(prod);
}

// R rows of x against weight row ``col``: out [R].
template <int R, int B, int G, int S, bool SIGNED, bool OFFSET>
void super_block(const QuantWeight& w, const SuperRows& xq, int64_t r0, int64_t col, float* out) {
  using Lay = SuperLayout<B, G, S>;
  const int64_t k = w.k, ng = w.num_groups, ns = w.num_super;
  const uint8_t* codes = w.codes + col * w.row_bytes;
  const uint8_t* scales = static_cast<const uint8_t*>(w.group_scale) + col * ng;
  const uint8_t* mins = OFFSET ? static_cast<const uint8_t*>(w.group_offset) + col * ng : nullptr;
  const float* d = w.super_scale + col * ns;
  const float* dmin = OFFSET ? w.super_offset + col * ns : nullptr;
  const int8_t* x = xq.codes.data() + r0 * k;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < ns; ++b) {
    __m256i sc[Lay::kHalves];
    for (int h = 0; h < Lay::kHalves; ++h)
      sc[h] = widen_scales<SIGNED, Lay::kPerHalf>(scales + b * S + h * 8);
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    const uint8_t* block = codes + b * Lay::kUnits * 32;
    const int8_t* xb = x + b * Lay::kSpan;
#pragma GCC unroll 8
    for (int u = 0; u < Lay::kUnits; ++u) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + u * 32));
      // The next weight row at this offset, 128 bytes (see prefetch_next_block).
      if (u % 4 == 0) prefetch_next_block(block + u * 32 + w.row_bytes);
      const __m256i spread = _mm256_load_si256(
          reinterpret_cast<const __m256i*>(kScaleSpread.control[Lay::spread(u)]));
      const __m256i scale = _mm256_shuffle_epi8(sc[Lay::half(u)], spread);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xb + r * k + u * Lay::kUnitValues;
        __m256i pairs;
        if constexpr (B == 4) {
          const __m256i lo = _mm256_and_si256(raw, mask);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
          const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
          const __m256i xc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32));
          pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xc));
        } else {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
          pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(raw, raw), _mm256_sign_epi8(xv, raw));
        }
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, scale));
      }
    }
    __m128i m16[Lay::kHalves];
    if constexpr (OFFSET) widen_mins<Lay>(mins + b * S, m16);
    for (int r = 0; r < R; ++r) {
      const float dx = xq.scale[(r0 + r) * ns + b];
      total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(d[b] * dx), total[r]);
      if constexpr (OFFSET) {
        const int16_t* sums = xq.sums.data() + (r0 + r) * ng + b * S;
        const __m256 offsets = _mm256_zextps128_ps256(offset_sums<Lay>(m16, sums));
        total[r] = _mm256_fmadd_ps(offsets, _mm256_set1_ps(-dmin[b] * dx), total[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum256(total[r]);
}

#if defined(LLM_SUITE_SUPER_512)
// super_block with 64-byte loads: units u and u + 1 side by side in one register, their scale
// vectors joined (the same integer sums, 16 float lanes). AVX-512 has no vpsignb: 8-bit codes
// take |w| and x negated where w < 0 (x where w == 0 meets |w| = 0 either way).
template <int R, int B, int G, int S, bool SIGNED, bool OFFSET>
void super_block_512(const QuantWeight& w, const SuperRows& xq, int64_t r0, int64_t col,
                     float* out) {
  using Lay = SuperLayout<B, G, S>;
  static_assert(Lay::kUnits % 2 == 0, "units come in pairs");
  const int64_t k = w.k, ng = w.num_groups, ns = w.num_super;
  const uint8_t* codes = w.codes + col * w.row_bytes;
  const uint8_t* scales = static_cast<const uint8_t*>(w.group_scale) + col * ng;
  const uint8_t* mins = OFFSET ? static_cast<const uint8_t*>(w.group_offset) + col * ng : nullptr;
  const float* d = w.super_scale + col * ns;
  const float* dmin = OFFSET ? w.super_offset + col * ns : nullptr;
  const int8_t* x = xq.codes.data() + r0 * k;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < ns; ++b) {
    __m256i sc[Lay::kHalves];
    for (int h = 0; h < Lay::kHalves; ++h)
      sc[h] = widen_scales<SIGNED, Lay::kPerHalf>(scales + b * S + h * 8);
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    const uint8_t* block = codes + b * Lay::kUnits * 32;
    const int8_t* xb = x + b * Lay::kSpan;
#pragma GCC unroll 4
    for (int u = 0; u < Lay::kUnits; u += 2) {
      const __m512i raw = _mm512_loadu_si512(block + u * 32);
      if (u % 4 == 0) prefetch_next_block(block + u * 32 + w.row_bytes);
      const auto spread = [](int unit) {
        return _mm256_load_si256(
            reinterpret_cast<const __m256i*>(kScaleSpread.control[Lay::spread(unit)]));
      };
      const __m512i scale = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_shuffle_epi8(sc[Lay::half(u)], spread(u))),
          _mm256_shuffle_epi8(sc[Lay::half(u + 1)], spread(u + 1)), 1);
      __m512i lo, hi, magnitude;
      __mmask64 negative = 0;
      if constexpr (B == 4) {
        lo = _mm512_and_si512(raw, mask);
        hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
      } else {
        magnitude = _mm512_abs_epi8(raw);
        negative = _mm512_movepi8_mask(raw);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xb + r * k + u * Lay::kUnitValues;
        __m512i pairs;
        if constexpr (B == 4) {
          const __m512i xa = _mm512_loadu_si512(xr);
          const __m512i xc = _mm512_loadu_si512(xr + 64);
          pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo, xa), _mm512_maddubs_epi16(hi, xc));
        } else {
          const __m512i xv = _mm512_loadu_si512(xr);
          const __m512i signed_x = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
          pairs = _mm512_maddubs_epi16(magnitude, signed_x);
        }
#if defined(__AVX512VNNI__)
        acc[r] = _mm512_dpwssd_epi32(acc[r], pairs, scale);  // the madd and add in one
#else
        acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(pairs, scale));
#endif
      }
    }
    __m128i m16[Lay::kHalves];
    if constexpr (OFFSET) widen_mins<Lay>(mins + b * S, m16);
    for (int r = 0; r < R; ++r) {
      const float dx = xq.scale[(r0 + r) * ns + b];
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(d[b] * dx), total[r]);
      if constexpr (OFFSET) {
        const int16_t* sums = xq.sums.data() + (r0 + r) * ng + b * S;
        const __m512 offsets = _mm512_zextps128_ps512(offset_sums<Lay>(m16, sums));
        total[r] = _mm512_fmadd_ps(offsets, _mm512_set1_ps(-dmin[b] * dx), total[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(total[r]);
}
#endif

// Columns [col, col1) of rows [r, r + R), one weight row at a time: the rows are contiguous,
// so a thread reads one sequential stream. Four short rows side by side (K = 2048: 1 KB each
// at 4 bits) are four streams that the prefetchers follow badly: 13.6 against 18 GB/s on a
// 75 MB Q4_K matrix with one row of x, 2 threads (EPYC, AVX2); with eight rows of x, one
// weight row at a time was as fast as two (~65 GMAC/s).
template <int R, int B, int G, int S, bool SIGNED, bool OFFSET>
void super_tile(const QuantWeight& w, const SuperRows& xq, int64_t r, int64_t col, int64_t col1,
                const QuantOut& sink) {
  float ys[R];
  for (; col < col1; ++col) {
    prefetch_scales(w, col + 1);
#if defined(LLM_SUITE_SUPER_512)
    super_block_512<R, B, G, S, SIGNED, OFFSET>(w, xq, r, col, ys);
#else
    super_block<R, B, G, S, SIGNED, OFFSET>(w, xq, r, col, ys);
#endif
    for (int i = 0; i < R; ++i) sink.put(r + i, col, ys[i]);
  }
}

template <typename Fn>
inline bool with_super_layout(const QuantWeight& w, Fn&& fn) {
  const bool has_super = w.super_scale || w.super_scale_half;
  if (!has_super || w.k % (w.group * w.groups_per_super) != 0) return false;
  const bool is_u8 = w.scale_type == at::kByte, is_i8 = w.scale_type == at::kChar;
  const bool has_offset = w.group_offset != nullptr;
  const bool has_super_offset = w.super_offset || w.super_offset_half;
  if (has_offset && (w.offset_type != at::kByte || !has_super_offset)) return false;
  const auto call = [&](auto b, auto g, auto s, auto is_signed, auto is_offset) {
    fn(b, g, s, is_signed, is_offset);
    return true;
  };
  using Yes = std::true_type;
  using No = std::false_type;
  const int64_t s = w.groups_per_super;
  if (w.group == 32 && is_u8 && has_offset && (w.bits == 4 || w.bits == 8)) {
    if (w.bits == 4 && s == 8) return call(Const<4>{}, Const<32>{}, Const<8>{}, No{}, Yes{});
    if (w.bits == 4 && s == 4) return call(Const<4>{}, Const<32>{}, Const<4>{}, No{}, Yes{});
    if (w.bits == 8 && s == 8) return call(Const<8>{}, Const<32>{}, Const<8>{}, No{}, Yes{});
  }
  if (w.bits == 8 && w.group == 16 && is_i8 && !has_offset && s == 16)
    return call(Const<8>{}, Const<16>{}, Const<16>{}, Yes{}, No{});
  return false;
}

inline bool super_layout(const QuantWeight& w) {
  return with_super_layout(w, [](auto, auto, auto, auto, auto) {});
}

// y = x . W^T (+ bias) with x quantised per super-block; the caller checked super_layout(w).
at::Tensor quant_linear_super(const at::Tensor& x, const QuantWeight& w,
                              const c10::optional<at::Tensor>& bias) {
  const QuantCall call = begin_quant_call(x, w, bias);
  if (call.is_empty()) return call.out;
  const int64_t m = call.m, n = call.n;
  const QuantOut& sink = call.sink;
  with_super_layout(w, [&](auto b, auto g, auto s, auto is_signed, auto is_offset) {
    constexpr int B = decltype(b)::value, G = decltype(g)::value, S = decltype(s)::value;
    constexpr bool SIGNED = decltype(is_signed)::value, OFFSET = decltype(is_offset)::value;
    const SuperRows& xq = quantize_super(call.x, G * S, G, B == 4);
    at::parallel_for(0, (n + kQuantColumns - 1) / kQuantColumns, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t chunk = c0; chunk < c1; ++chunk) {
        const int64_t col0 = chunk * kQuantColumns, col1 = std::min(n, col0 + kQuantColumns);
        for (int64_t r = 0; r < m; r += kQuantTileRows) {
          switch (std::min(kQuantTileRows, m - r)) {
            case 4: super_tile<4, B, G, S, SIGNED, OFFSET>(w, xq, r, col0, col1, sink); break;
            case 3: super_tile<3, B, G, S, SIGNED, OFFSET>(w, xq, r, col0, col1, sink); break;
            case 2: super_tile<2, B, G, S, SIGNED, OFFSET>(w, xq, r, col0, col1, sink); break;
            default: super_tile<1, B, G, S, SIGNED, OFFSET>(w, xq, r, col0, col1, sink); break;
          }
        }
      }
    });
  });
  return call.out;
}
#endif

}  // namespace
