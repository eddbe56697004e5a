// Matmul with weights that stay quantised (GGUF Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K repacked at load
// by quantization/packed_gguf.py): y[M, N] = x[M, K] . W^T (+ bias), W dequantised inside the
// kernel, group by group, in registers.
//
// Layout of W (one row per output column n, K along the row, in groups of G = 16 or 32):
//   codes         bits 4: uint8 [N, K/2], per group byte j = element j (low nibble) and
//                 element j + G/2 (high nibble), 0..15; bits 8: int8 [N, K]
//   group_scale   [N, K/G] float16 (legacy types: the block's own d) or int8/uint8 (K-quants:
//                 the 6-/8-bit sub-block multiplier)
//   group_offset  optional, [N, K/G] float16 or uint8, likewise
//   super_scale   optional float32 [N, K/(G*S)]: with it a group's scale is
//                 super_scale[g / S] * group_scale[g] (K-quants' d * sc); super_offset likewise
// value = scale * q - offset, the float32 products gguf's own dequantiser computes, so the
// dequantised weight matches gguf.quants.dequantize exactly.
//
// The kernel uses sum_j x_j (s q_j - o) = s * (sum_j x_j q_j) - o * (sum_j x_j): per group one
// dot of x with the unpacked codes, scaled once; the offsets meet per-group sums of x computed
// once per call. Each group's codes are unpacked once per tile of up to kQuantTileRows rows of x
// and reused by all of them (decode reads the packed bytes once). Threads split the columns.
#pragma once

#include "simd.h"

namespace {

// What one call needs to know about the packed weight (pointers into the caller's tensors).
struct QuantWeight {
  const uint8_t* codes;
  int64_t n, k, group, num_groups, row_bytes;
  int bits;
  at::ScalarType scale_type, offset_type;
  const void* group_scale;
  const void* group_offset;  // nullptr: no offsets
  const float* super_scale;  // nullptr: group_scale is the scale
  const float* super_offset;
  // The tiled layout's alternative (lane_tiles.h): fp16 super scale and offset, where exact.
  const c10::Half* super_scale_half;
  const c10::Half* super_offset_half;
  int64_t num_super, groups_per_super;
};

template <typename T>
inline void widen_row(const T* __restrict src, float* __restrict dst, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<float>(src[i]);
}

#if defined(__F16C__)
// fp16 scales, 8 at a time: c10::Half's own conversion is scalar, and this runs for every
// weight row of every call (a third of a decode matmul's time before).
template <>
inline void widen_row(const c10::Half* __restrict src, float* __restrict dst, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(src + i))));
  for (; i < count; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

// dst[0..count) = the small values base[offset..offset+count) of ``type`` as float32.
inline void small_to_float(const void* base, at::ScalarType type, int64_t offset, float* dst,
                           int64_t count) {
  switch (type) {
    case at::kHalf: return widen_row(static_cast<const c10::Half*>(base) + offset, dst, count);
    case at::kChar: return widen_row(static_cast<const int8_t*>(base) + offset, dst, count);
    case at::kByte: return widen_row(static_cast<const uint8_t*>(base) + offset, dst, count);
    default: return widen_row(static_cast<const float*>(base) + offset, dst, count);
  }
}

// values[g] *= super[row's super-block of g]: the K-quants' d * sc, in float32 as gguf does.
inline void times_super(float* values, const float* super, const QuantWeight& w, int64_t row) {
  const float* sup = super + row * w.num_super;
  for (int64_t b = 0; b < w.num_super; ++b)
    for (int64_t j = 0; j < w.groups_per_super; ++j) values[b * w.groups_per_super + j] *= sup[b];
}

// float32 scale and offset of every group of weight row ``row`` (1/G of the work; one type
// switch per row, no per-group division: it runs for every column of every call).
inline void expand_one(const void* base, at::ScalarType type, const float* super,
                       const QuantWeight& w, int64_t row, float* dst) {
#if defined(__AVX2__)
  // K-quants (8-bit group scales, whole vectors of groups per super-block): widened and
  // multiplied in one pass, 8 groups an instruction. The generic passes below took a third
  // of a decode matmul's time once its loads were prefetched.
  if (super && (type == at::kByte || type == at::kChar) && w.groups_per_super % 8 == 0) {
    // Locals, not w's fields: stores to dst could alias them, and g++ reloaded them per step.
    const int64_t num_groups = w.num_groups, per_super = w.groups_per_super;
    const uint8_t* src = static_cast<const uint8_t*>(base) + row * num_groups;
    const float* sup = super + row * w.num_super;
    const bool is_signed = type == at::kChar;
    for (int64_t g = 0, b = 0; g < num_groups; ++b) {
      const __m256 scale = _mm256_set1_ps(sup[b]);
      for (const int64_t end = g + per_super; g < end; g += 8) {
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + g));
        const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
        _mm256_storeu_ps(dst + g, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), scale));
      }
    }
    return;
  }
#endif
  small_to_float(base, type, row * w.num_groups, dst, w.num_groups);
  if (super) times_super(dst, super, w, row);
}

inline void prefetch_bytes(const void* p, int64_t num_bytes) {
  const char* bytes = static_cast<const char*>(p);
  for (int64_t i = 0; i < num_bytes; i += 64) __builtin_prefetch(bytes + i, 0, 3);
}

// Weight row ``row``'s scales and offsets into cache ahead of expand_scales: they are separate
// small arrays per row that the hardware prefetcher does not follow, and expanding them stalled
// on their loads (a sixth of a Q4_K_M decode step under perf, before this).
inline void prefetch_scales(const QuantWeight& w, int64_t row) {
  if (row >= w.n) return;
  const int64_t ng = w.num_groups;
  const int64_t scale_bytes = ng * static_cast<int64_t>(c10::elementSize(w.scale_type));
  prefetch_bytes(static_cast<const char*>(w.group_scale) + row * scale_bytes, scale_bytes);
  if (w.group_offset) {
    const int64_t offset_bytes = ng * static_cast<int64_t>(c10::elementSize(w.offset_type));
    prefetch_bytes(static_cast<const char*>(w.group_offset) + row * offset_bytes, offset_bytes);
  }
  if (w.super_scale) prefetch_bytes(w.super_scale + row * w.num_super, w.num_super * 4);
  if (w.super_offset) prefetch_bytes(w.super_offset + row * w.num_super, w.num_super * 4);
}

inline void expand_scales(const QuantWeight& w, int64_t row, float* s, float* o) {
  expand_one(w.group_scale, w.scale_type, w.super_scale, w, row, s);
  if (w.group_offset) expand_one(w.group_offset, w.offset_type, w.super_offset, w, row, o);
}

// The rows of the next block of columns, one block (NC rows) ahead of the loads: a block
// reads NC short rows (K/2 bytes each at 4 bits) side by side, too short for the hardware
// prefetcher to ramp up on, and the decode matmuls stalled on those loads (half their
// samples under perf; prefetching made them about 2x faster).
inline void prefetch_next_block(const uint8_t* p) {  // 128 bytes
  __builtin_prefetch(p, 0, 3);
  __builtin_prefetch(p + 64, 0, 3);
}

// Code i of a group (the scalar reference kernel and the tails).
inline float code_at(const uint8_t* group_codes, int bits, int64_t group, int64_t i) {
  if (bits == 8) return static_cast<float>(reinterpret_cast<const int8_t*>(group_codes)[i]);
  const int64_t half = group / 2;
  const uint8_t byte = group_codes[i % half];
  return static_cast<float>(i < half ? (byte & 0x0F) : (byte >> 4));
}

// The plain loops: every weight dequantised one at a time. Reference for the vector kernel.
void quant_rows_scalar(const QuantWeight& w, const float* x, const float* xsum, int64_t rows,
                       int64_t col, float* s, float* o, float* out) {
  expand_scales(w, col, s, o);
  const uint8_t* codes = w.codes + col * w.row_bytes;
  const int64_t group_bytes = w.group * w.bits / 8;
  for (int64_t r = 0; r < rows; ++r) {
    float y = 0.0f;
    for (int64_t g = 0; g < w.num_groups; ++g) {
      float dot_q = 0.0f;
      for (int64_t i = 0; i < w.group; ++i)
        dot_q += x[r * w.k + g * w.group + i] * code_at(codes + g * group_bytes, w.bits, w.group, i);
      y += s[g] * dot_q - (w.group_offset ? o[g] * xsum[r * w.num_groups + g] : 0.0f);
    }
    out[r] = y;
  }
}

#if defined(LLM_SUITE_HAS_SIMD)

// The G codes of one group as G / W float vectors, in element order.
template <int B, int G>
inline void unpack_group(const uint8_t* p, typename Simd::F* q) {
  using F = typename Simd::F;
  constexpr int W = Simd::W;
  if constexpr (B == 8) {
    for (int v = 0; v < G / W; ++v) {
#if defined(__AVX512F__)
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + v * W));
      q[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
#else
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + v * W));
      q[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
#endif
    }
    return;
  }
  // 4 bits, G = 32: 16 bytes, low nibbles = elements 0..15, high = 16..31.
  static_assert(G == 32 || G == 16, "groups of 16 or 32");
  if constexpr (G == 32) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
#if defined(__AVX512F__)
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
#else
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
#endif
  } else {
    (void)q;
    TORCH_CHECK(false, "4-bit codes come in groups of 32");
  }
  (void)sizeof(F);
}

// R rows of x (float32, row stride k) against weight row ``col``: out[r] = y[r][col] less bias.
template <int R, int B, int G>
void quant_rows_simd(const QuantWeight& w, const float* x, const float* xsum, int64_t col,
                     float* s, float* o, float* out) {
  using S = Simd;
  using F = S::F;
  constexpr int V = G / S::W;
  expand_scales(w, col, s, o);
  const uint8_t* codes = w.codes + col * w.row_bytes;
  const int64_t group_bytes = G * B / 8, k = w.k;
  F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = S::zero();
  for (int64_t g = 0; g < w.num_groups; ++g) {
    F q[V];
    unpack_group<B, G>(codes + g * group_bytes, q);
    const F scale = S::set1(s[g]);
    const float* xg = x + g * G;
    for (int r = 0; r < R; ++r) {
      F t = S::mul(S::load(xg + r * k), q[0]);
      for (int v = 1; v < V; ++v) t = S::fmadd(S::load(xg + r * k + v * S::W), q[v], t);
      acc[r] = S::fmadd(scale, t, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r] = S::reduce_add(acc[r]);
    if (w.group_offset) out[r] -= dot(o, xsum + r * w.num_groups, w.num_groups);
  }
}

// Decode (one row of x): NC weight rows at once, sharing each load of x and giving the core
// NC independent sums to overlap (one column at a time ran at half the bf16 kernel's rate).
template <int NC, int B, int G>
void quant_cols_simd(const QuantWeight& w, const float* x, const float* xsum, int64_t col0,
                     float* s, float* o, float* out) {
  using S = Simd;
  using F = S::F;
  constexpr int V = G / S::W;
  const int64_t ng = w.num_groups, group_bytes = G * B / 8;
  for (int c = 0; c < NC; ++c) {
    expand_scales(w, col0 + c, s + c * ng, o + c * ng);
    prefetch_scales(w, col0 + NC + c);
  }
  const uint8_t* codes = w.codes + col0 * w.row_bytes;
  F acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = S::zero();
  for (int64_t g = 0; g < ng; ++g) {
    F xv[V];
    for (int v = 0; v < V; ++v) xv[v] = S::load(x + g * G + v * S::W);
    const bool is_prefetching = (g * group_bytes) % 128 == 0;
    for (int c = 0; c < NC; ++c) {
      F q[V];
      unpack_group<B, G>(codes + c * w.row_bytes + g * group_bytes, q);
      if (is_prefetching) prefetch_next_block(codes + (c + NC) * w.row_bytes + g * group_bytes);
      F t = S::mul(xv[0], q[0]);
      for (int v = 1; v < V; ++v) t = S::fmadd(xv[v], q[v], t);
      acc[c] = S::fmadd(S::set1(s[c * ng + g]), t, acc[c]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    out[c] = S::reduce_add(acc[c]);
    if (w.group_offset) out[c] -= dot(o + c * ng, xsum, ng);
  }
}

template <int B, int G>
void quant_tile_simd(const QuantWeight& w, const float* x, const float* xsum, int64_t rows,
                     int64_t col, float* s, float* o, float* out) {
  switch (rows) {
    case 4: quant_rows_simd<4, B, G>(w, x, xsum, col, s, o, out); break;
    case 3: quant_rows_simd<3, B, G>(w, x, xsum, col, s, o, out); break;
    case 2: quant_rows_simd<2, B, G>(w, x, xsum, col, s, o, out); break;
    default: quant_rows_simd<1, B, G>(w, x, xsum, col, s, o, out); break;
  }
}

// The layouts the vector kernels take, as template arguments (bits and group size known at
// compile time: a runtime test inside the loops made g++ split them into branchy pieces that
// ran at a sixth of the bf16 kernel's rate). Returns false for any other layout.
template <typename Fn>
inline bool with_layout(const QuantWeight& w, Fn&& fn) {
  if (w.bits == 4 && w.group == 32) return fn(std::integral_constant<int, 4>{}, std::integral_constant<int, 32>{}), true;
  if (w.bits == 8 && w.group == 32) return fn(std::integral_constant<int, 8>{}, std::integral_constant<int, 32>{}), true;
  if (w.bits == 8 && w.group == 16) return fn(std::integral_constant<int, 8>{}, std::integral_constant<int, 16>{}), true;
  return false;
}
#endif

// One tile of rows against one weight row, by the vector kernel where this build has one.
inline void quant_tile(const QuantWeight& w, const float* x, const float* xsum, int64_t rows,
                       int64_t col, float* s, float* o, float* out, bool is_scalar) {
#if defined(LLM_SUITE_HAS_SIMD)
  const auto tile = [&](auto b, auto g) {
    quant_tile_simd<decltype(b)::value, decltype(g)::value>(w, x, xsum, rows, col, s, o, out);
  };
  if (!is_scalar && with_layout(w, tile)) return;
#endif
  quant_rows_scalar(w, x, xsum, rows, col, s, o, out);
}

QuantWeight quant_weight_of(const at::Tensor& codes, int64_t bits, int64_t group,
                            const at::Tensor& group_scale,
                            const c10::optional<at::Tensor>& group_offset,
                            const c10::optional<at::Tensor>& super_scale,
                            const c10::optional<at::Tensor>& super_offset) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "codes of 4, 5 or 6 (tiled) or 8 bits");
  TORCH_CHECK(group == 16 || group == 32, "groups of 16 or 32");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous(), "codes [N, K*bits/8] contiguous");
  TORCH_CHECK(group_scale.dim() == 2 && group_scale.is_contiguous(), "group_scale [N, K/G]");
  QuantWeight w{};
  w.codes = static_cast<const uint8_t*>(codes.data_ptr());
  w.n = codes.size(0);
  w.row_bytes = codes.size(1);
  w.k = w.row_bytes * 8 / bits;
  w.group = group;
  w.bits = static_cast<int>(bits);
  w.num_groups = w.k / group;
  TORCH_CHECK(group_scale.size(0) == w.n && group_scale.size(1) == w.num_groups, "scale shape");
  w.scale_type = group_scale.scalar_type();
  w.group_scale = group_scale.data_ptr();
  w.offset_type = at::kFloat;
  if (group_offset && group_offset->defined()) {
    TORCH_CHECK(group_offset->sizes() == group_scale.sizes() && group_offset->is_contiguous(),
                "group_offset shape");
    w.offset_type = group_offset->scalar_type();
    w.group_offset = group_offset->data_ptr();
  }
  w.num_super = 1;
  w.groups_per_super = w.num_groups;
  if (super_scale && super_scale->defined()) {
    const bool is_half = super_scale->scalar_type() == at::kHalf;
    TORCH_CHECK((is_half || super_scale->scalar_type() == at::kFloat) &&
                    super_scale->is_contiguous() && super_scale->size(0) == w.n &&
                    w.num_groups % super_scale->size(1) == 0,
                "super_scale float32 (or fp16, tiled) [N, K/(G*S)]");
    w.num_super = super_scale->size(1);
    w.groups_per_super = w.num_groups / w.num_super;
    if (is_half)
      w.super_scale_half = super_scale->data_ptr<c10::Half>();
    else
      w.super_scale = super_scale->data_ptr<float>();
    if (super_offset && super_offset->defined()) {
      TORCH_CHECK(super_offset->sizes() == super_scale->sizes() && super_offset->is_contiguous() &&
                      super_offset->scalar_type() == super_scale->scalar_type(),
                  "super_offset: super_scale's shape and dtype");
      if (is_half)
        w.super_offset_half = super_offset->data_ptr<c10::Half>();
      else
        w.super_offset = super_offset->data_ptr<float>();
    }
  }
  return w;
}

// Rows of x per tile (the scalar loops take one at a time).
constexpr int64_t kQuantTileRows = 4;
// Weight rows the decode kernel (one row of x) takes at once.
constexpr int kQuantDecodeColumns = 4;
// Columns per work unit: their codes stay in cache while every row tile passes over them.
constexpr int64_t kQuantColumns = 16;

// Where a call writes: [m, n] in x's dtype (rounded once), the float32 bias added.
struct QuantOut {
  at::BFloat16* bf16;
  float* f32;
  const float* bias;
  int64_t n;
  void put(int64_t row, int64_t col, float y) const {
    y += bias ? bias[col] : 0.0f;
    if (bf16)
      bf16[row * n + col] = c10::BFloat16(y);  // nearest even
    else
      f32[row * n + col] = y;
  }
};

// The call's bias as float32 (undefined: none), checked against the n outputs.
inline at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "bias size");
  return bias->to(at::kFloat).contiguous();
}

// Where a call writes ``out`` [m, n] (its dtype bf16 or float32), ``bias_f`` added.
inline QuantOut sink_of(const at::Tensor& out, const at::Tensor& bias_f) {
  const bool is_bf16 = out.scalar_type() == at::kBFloat16;
  return QuantOut{is_bf16 ? out.data_ptr<at::BFloat16>() : nullptr,
                  is_bf16 ? nullptr : out.data_ptr<float>(),
                  bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, out.size(1)};
}

// What the int8-activation kernels start from: x contiguous in its own dtype (float32 or
// bf16: they quantise it straight from there), the output [M, N] in x's dtype, and where each
// output goes, bias added (none for an empty product: ``out`` is the answer).
struct QuantCall {
  at::Tensor x, out, bias_f;
  QuantOut sink{};
  int64_t m, n;
  bool is_empty() const { return m == 0 || n == 0; }
};

inline QuantCall begin_quant_call(const at::Tensor& x, const QuantWeight& w,
                                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k, "x must be [M, K]");
  QuantCall call{x.contiguous(), at::Tensor(), at::Tensor(), {}, x.size(0), w.n};
  call.out = at::empty({call.m, call.n}, x.options());
  if (call.is_empty()) return call;
  call.bias_f = float_bias(bias, call.n);
  call.sink = sink_of(call.out, call.bias_f);
  return call;
}

#if defined(LLM_SUITE_HAS_SIMD)
// Vector v (of G / W) of a group's codes as floats: the M > 1 kernel unpacks one at a time.
template <int B, int G>
inline typename Simd::F unpack_one(const uint8_t* p, int v) {
  constexpr int W = Simd::W, V = G / W;
#if defined(__AVX512F__)
  if constexpr (B == 8)
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + v * W))));
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));  // V == 2
  if (v) raw = _mm_srli_epi16(raw, 4);
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, _mm_set1_epi8(0x0F))));
#else
  if constexpr (B == 8)
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + v * W))));
  // 4 bits (V == 4): bytes 0-7 or 8-15, low nibbles for v < 2, high ones after.
  __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + (v % (V / 2)) * W));
  if (v >= V / 2) raw = _mm_srli_epi16(raw, 4);
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(raw, _mm_set1_epi8(0x0F))));
#endif
}

// M > 1: R rows of x against NC weight rows. Each weight vector is dequantised once in
// registers (scale * code - offset, one fma) and used by all R rows, so the tile does R * NC
// multiply-adds per NC unpacks; the sums need no per-group scaling. out: [R][NC].
template <int R, int NC, int B, int G>
void quant_block_simd(const QuantWeight& w, const float* x, int64_t col0, float* s, float* o,
                      float* out) {
  using S = Simd;
  using F = S::F;
  constexpr int V = G / S::W;
  const int64_t ng = w.num_groups, group_bytes = G * B / 8, k = w.k;
  for (int c = 0; c < NC; ++c) {
    expand_scales(w, col0 + c, s + c * ng, o + c * ng);
    if (!w.group_offset) std::fill(o + c * ng, o + (c + 1) * ng, 0.0f);
  }
  const uint8_t* codes = w.codes + col0 * w.row_bytes;
  F acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = S::zero();
  for (int64_t g = 0; g < ng; ++g) {
    for (int v = 0; v < V; ++v) {
      F wv[NC];
      for (int c = 0; c < NC; ++c) {
        const F q = unpack_one<B, G>(codes + c * w.row_bytes + g * group_bytes, v);
        wv[c] = S::fmadd(S::set1(s[c * ng + g]), q, S::set1(-o[c * ng + g]));
      }
      for (int r = 0; r < R; ++r) {
        const F xr = S::load(x + r * k + g * G + v * S::W);
        for (int c = 0; c < NC; ++c) acc[r][c] = S::fmadd(xr, wv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) out[r * NC + c] = S::reduce_add(acc[r][c]);
}

template <int B, int G>
void quant_block_rows(const QuantWeight& w, const float* x, int64_t rows, int64_t col0,
                      float* s, float* o, float* out) {
  switch (rows) {
    case 4: return quant_block_simd<4, 2, B, G>(w, x, col0, s, o, out);
    case 3: return quant_block_simd<3, 2, B, G>(w, x, col0, s, o, out);
    default: return quant_block_simd<2, 2, B, G>(w, x, col0, s, o, out);
  }
}

// The vector kernels over columns [col, col1) of one row tile, as far as they go; returns the
// first column they left (to the per-column path).
template <int B, int G>
int64_t quant_tile_columns(const QuantWeight& w, const float* a, const float* sums, int64_t r,
                           int64_t rows, int64_t col, int64_t col1, float* scratch,
                           const QuantOut& out) {
  const int64_t ng = w.num_groups, k = w.k;
  float* s = scratch;
  float* o = scratch + kQuantDecodeColumns * ng;
  float* ys = scratch + 2 * kQuantDecodeColumns * ng;
  if (rows == 1) {  // decode: four columns at a time
    for (; col + kQuantDecodeColumns <= col1; col += kQuantDecodeColumns) {
      quant_cols_simd<kQuantDecodeColumns, B, G>(w, a + r * k, sums + r * ng, col, s, o, ys);
      for (int c = 0; c < kQuantDecodeColumns; ++c) out.put(r, col + c, ys[c]);
    }
    return col;
  }
  for (; col + 2 <= col1; col += 2) {
    quant_block_rows<B, G>(w, a + r * k, rows, col, s, o, ys);
    for (int64_t i = 0; i < rows; ++i)
      for (int c = 0; c < 2; ++c) out.put(r + i, col + c, ys[i * 2 + c]);
  }
  return col;
}

int64_t quant_tile_vector(const QuantWeight& w, const float* a, const float* sums, int64_t r,
                          int64_t rows, int64_t col, int64_t col1, float* scratch,
                          const QuantOut& out) {
  int64_t next = col;
  with_layout(w, [&](auto b, auto g) {
    next = quant_tile_columns<decltype(b)::value, decltype(g)::value>(w, a, sums, r, rows, col,
                                                                       col1, scratch, out);
  });
  return next;
}
#endif

at::Tensor quant_linear_impl(const at::Tensor& x, const QuantWeight& w,
                             const c10::optional<at::Tensor>& bias, bool is_scalar) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k, "x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const auto xf = x.to(at::kFloat).contiguous();  // widened once: every column reads it
  const int64_t m = x.size(0), k = w.k, ng = w.num_groups, n = w.n;
  auto out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  // Per-group sums of x: the offsets' share of each output, one dot per column.
  const auto xsum = xf.view({m, ng, w.group}).sum(-1).contiguous();
  const at::Tensor bias_f = float_bias(bias, n);
  const QuantOut sink = sink_of(out, bias_f);
  const float* a = xf.data_ptr<float>();
  const float* sums = xsum.data_ptr<float>();
  const int64_t tile = is_scalar ? 1 : kQuantTileRows;
  const bool is_vector = !is_scalar && (w.group == 32 || (w.group == 16 && w.bits == 8));
  at::parallel_for(0, (n + kQuantColumns - 1) / kQuantColumns, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> scratch(2 * kQuantDecodeColumns * ng + 2 * kQuantTileRows * 2);
    float ys[kQuantTileRows];
    for (int64_t chunk = c0; chunk < c1; ++chunk) {
      const int64_t col0 = chunk * kQuantColumns, col1 = std::min(n, col0 + kQuantColumns);
      for (int64_t r = 0; r < m; r += tile) {
        const int64_t rows = std::min(tile, m - r);
        int64_t col = col0;
#if defined(LLM_SUITE_HAS_SIMD)
        if (is_vector) col = quant_tile_vector(w, a, sums, r, rows, col, col1, scratch.data(), sink);
#endif
        for (; col < col1; ++col) {
          quant_tile(w, a + r * k, sums + r * ng, rows, col, scratch.data(),
                     scratch.data() + ng, ys, is_scalar);
          for (int64_t i = 0; i < rows; ++i) sink.put(r + i, col, ys[i]);
        }
      }
    }
  });
  return out;
}

}  // namespace
