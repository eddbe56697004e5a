// The packed-GGUF matmul (qgemm.h) with int8 activations, as llama.cpp runs its quantised
// matmuls: each row of x is quantised per weight group (d = max|x| / 127, codes rounded to
// nearest even), and a group's dot product is integer work: _mm256_maddubs_epi16 of the
// weight codes (unsigned 4-bit, or |int8| with x's signs moved over) with x's codes, widened
// by _mm256_madd_epi16, then one float multiply-add with the product of the two scales.
//   y = sum_g s_g d_g (q_g . xq_g) - sum_g o_g (d_g sum xq_g)
// which is exactly the float matmul of the dequantised weight with the dequantised x (the
// reference, ``PackedLinear.reference`` with int8 activations), up to float summation order.
// A step is 32 elements: one group of 32, or two groups of 16 (8-bit codes only).
#pragma once

#include "qgemm_panels.h"
#include "qgemm_lanes.h"
#include "qgemm_super.h"
#include "qgemm_vnni.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__)
#define LLM_SUITE_HAS_QGEMM_I8 1

// x [M, K] quantised per group: codes [M, K] int8, scales [M, K/G], and the groups' sums of
// the dequantised codes [M, K/G] (the offsets' share).
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<float> scale, sum;
};

QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k, int64_t group) {
  const int64_t ng = k / group;
  QuantizedRows q{std::vector<int8_t>(m * k), std::vector<float>(m * ng),
                  std::vector<float>(m * ng)};
  at::parallel_for(0, m * ng, 64, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const float* xs = x + g * group;
      float amax = 0.0f;
      for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(xs[i]));
      const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t total = 0;
      for (int64_t i = 0; i < group; ++i) {
        // nearbyint: round half to even (the default mode), as torch.round in the reference.
        const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xs[i] * inv)));
        q.codes[g * group + i] = static_cast<int8_t>(v);
        total += static_cast<int32_t>(v);
      }
      q.scale[g] = d;
      q.sum[g] = d * static_cast<float>(total);
    }
  });
  return q;
}

// Step t's 32 weight codes of one row, ready for maddubs: 4-bit codes as unsigned bytes in
// element order (low nibbles are elements 0-15, high ones 16-31); 8-bit codes as they are.
template <int B>
inline __m256i step_codes(const uint8_t* row, int64_t t) {
  if constexpr (B == 4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + t * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask),
                            _mm_and_si128(raw, mask));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + t * 32));
  }
}

// Steps t and t + 1 of 4-bit codes from one 32-byte load (two groups' 16 bytes each): one
// load and one mask for 64 weights, where step_codes takes a load, a shift, two masks and an
// insert for 32 (the decode matmul was bound by those ops, not by memory).
inline void step_codes_pair(const uint8_t* row, int64_t t, __m256i& q0, __m256i& q1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + t * 16));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(raw, mask);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
  q0 = _mm256_permute2x128_si256(lo, hi, 0x20);  // group t: elements 0-15, then 16-31
  q1 = _mm256_permute2x128_si256(lo, hi, 0x31);  // group t + 1
}

// Eight int32 sums of 4 products each of step codes q with x's codes (elements 4i..4i+3 in
// lane i). Products fit int16 pairs: 15 * 127 * 2 or 128 * 127 * 2 < 32768.
template <int B>
inline __m256i step_dot(__m256i q, __m256i x) {
  __m256i pairs;
  if constexpr (B == 4) {
    pairs = _mm256_maddubs_epi16(q, x);
  } else {
    pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
  }
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// The step's scale per lane: one group's s * d, or (G = 16) lanes 0-3 and 4-7 for two groups.
template <int G>
inline __m256 step_scale(const float* sd, int64_t t) {
  if constexpr (G == 32) return _mm256_set1_ps(sd[t]);
  return _mm256_set_m128(_mm_set1_ps(sd[2 * t + 1]), _mm_set1_ps(sd[2 * t]));
}

// values[i] = a[i] * b[i], 8 at a time.
inline void times_rows(float* values, const float* a, const float* b, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(values + i, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  for (; i < count; ++i) values[i] = a[i] * b[i];
}

// R rows of quantised x against NC weight rows from col0: out [R][NC]. ``sd`` holds each row's
// products of the columns' group scales with its own x scales, [R][NC][ng]; ``o`` the columns'
// expanded offsets, [NC][ng] (see quant_i8_columns).
// Loop order: per step, one column at a time and every row against it, so that only that
// column's codes are live (holding all NC columns' codes spilled registers to the stack).
template <int R, int NC, int B, int G>
void quant_i8_block(const QuantWeight& w, const QuantizedRows& xq, int64_t r0, int64_t col0,
                    const float* sd, const float* o, float* out) {
  const int64_t ng = w.num_groups, k = w.k, steps = k / 32;
  const uint8_t* codes = w.codes + col0 * w.row_bytes;
  const int8_t* x = xq.codes.data() + r0 * k;
  // Row r's products s * d against column c: [R][NC][ng].
  const auto scales = [&](int r, int c) { return sd + (r * NC + c) * ng; };
  __m256 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t t = 0;
  if constexpr (B == 4) {
    for (; t + 2 <= steps; t += 2) {
      for (int c = 0; c < NC; ++c) {
        __m256i q0, q1;
        step_codes_pair(codes + c * w.row_bytes, t, q0, q1);
        // The next block's rows at this offset (see prefetch_next_block).
        if ((t & 7) == 0) prefetch_next_block(codes + (c + NC) * w.row_bytes + t * 16);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = x + r * k + t * 32;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32));
          const __m256 dots0 = _mm256_cvtepi32_ps(step_dot<B>(q0, x0));
          const __m256 dots1 = _mm256_cvtepi32_ps(step_dot<B>(q1, x1));
          acc[r][c] = _mm256_fmadd_ps(dots0, step_scale<G>(scales(r, c), t), acc[r][c]);
          acc[r][c] = _mm256_fmadd_ps(dots1, step_scale<G>(scales(r, c), t + 1), acc[r][c]);
        }
      }
    }
  }
  for (; t < steps; ++t) {
    for (int c = 0; c < NC; ++c) {
      const __m256i q = step_codes<B>(codes + c * w.row_bytes, t);
      if ((t & 3) == 0) prefetch_next_block(codes + (c + NC) * w.row_bytes + t * 32);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * k + t * 32));
        const __m256 dots = _mm256_cvtepi32_ps(step_dot<B>(q, xv));
        acc[r][c] = _mm256_fmadd_ps(dots, step_scale<G>(scales(r, c), t), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) {
      float y = hsum256(acc[r][c]);
      if (w.group_offset) y -= dot(o + c * ng, xq.sum.data() + (r0 + r) * ng, ng);
      out[r * NC + c] = y;
    }
}

template <int R, int NC, int B, int G>
int64_t quant_i8_columns(const QuantWeight& w, const QuantizedRows& xq, int64_t r, int64_t col,
                         int64_t col1, float* scratch, const QuantOut& sink) {
  const int64_t ng = w.num_groups;
  float* s = scratch;
  float* o = scratch + NC * ng;
  float* sd = scratch + 2 * NC * ng;  // [R][NC][ng]
  float ys[R * NC];
  for (; col + NC <= col1; col += NC) {
    for (int c = 0; c < NC; ++c) {
      expand_scales(w, col + c, s + c * ng, o + c * ng);
      prefetch_scales(w, col + NC + c);
      // Each row of x's group scales folded in once per column (the product s * d the loop
      // would form per group and row), leaving the loop one broadcast per group.
      for (int i = 0; i < R; ++i)
        times_rows(sd + (i * NC + c) * ng, s + c * ng, xq.scale.data() + (r + i) * ng, ng);
    }
    quant_i8_block<R, NC, B, G>(w, xq, r, col, sd, o, ys);
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < NC; ++c) sink.put(r + i, col + c, ys[i * NC + c]);
  }
  return col;
}

// Columns [col, col1) of rows [r, r + rows): NC columns at a time, then one by one, so that
// every output of the call uses the int8 activations.
template <int R, int B, int G>
void quant_i8_tile(const QuantWeight& w, const QuantizedRows& xq, int64_t r, int64_t col,
                   int64_t col1, float* scratch, const QuantOut& sink) {
  // One row of x: one weight row at a time, one sequential stream per thread (see
  // super_tile: Q8_0, 75 MB, 2 threads: 19.4 GB/s, against 12-15 with four rows at once).
  constexpr int NC = R == 1 ? 1 : 2;
  col = quant_i8_columns<R, NC, B, G>(w, xq, r, col, col1, scratch, sink);
  quant_i8_columns<R, 1, B, G>(w, xq, r, col, col1, scratch, sink);
}

// True when the int8 kernel takes this weight: the vector layouts, K whole steps of 32.
inline bool int8_layout(const QuantWeight& w) {
  return w.k % 32 == 0 &&
         ((w.bits == 4 && w.group == 32) || (w.bits == 8 && (w.group == 32 || w.group == 16)));
}

void quant_i8_rows(const QuantWeight& w, const QuantizedRows& xq, int64_t r, int64_t rows,
                   int64_t col, int64_t col1, float* scratch, const QuantOut& sink) {
  const auto run = [&](auto b, auto g) {
    constexpr int B = decltype(b)::value, G = decltype(g)::value;
    switch (rows) {
      case 4: return quant_i8_tile<4, B, G>(w, xq, r, col, col1, scratch, sink);
      case 3: return quant_i8_tile<3, B, G>(w, xq, r, col, col1, scratch, sink);
      case 2: return quant_i8_tile<2, B, G>(w, xq, r, col, col1, scratch, sink);
      default: return quant_i8_tile<1, B, G>(w, xq, r, col, col1, scratch, sink);
    }
  };
  if (w.bits == 4) return run(std::integral_constant<int, 4>{}, std::integral_constant<int, 32>{});
  if (w.group == 32) return run(std::integral_constant<int, 8>{}, std::integral_constant<int, 32>{});
  run(std::integral_constant<int, 8>{}, std::integral_constant<int, 16>{});
}

// y = x . W^T (+ bias) with int8 activations; the caller checked int8_layout(w).
at::Tensor quant_linear_i8(const at::Tensor& x, const QuantWeight& w,
                           const c10::optional<at::Tensor>& bias) {
  const QuantCall call = begin_quant_call(x, w, bias);
  if (call.is_empty()) return call.out;
  const int64_t m = call.m, n = call.n, ng = w.num_groups;
  const at::Tensor xf = call.x.to(at::kFloat);
  const QuantizedRows xq = quantize_rows(xf.data_ptr<float>(), m, w.k, w.group);
  const QuantOut& sink = call.sink;
  at::parallel_for(0, (n + kQuantColumns - 1) / kQuantColumns, 1, [&](int64_t c0, int64_t c1) {
    // s and o of up to two columns, and their products with up to four rows' x scales.
    std::vector<float> scratch((2 + kQuantTileRows) * 2 * ng);
    for (int64_t chunk = c0; chunk < c1; ++chunk) {
      const int64_t col0 = chunk * kQuantColumns, col1 = std::min(n, col0 + kQuantColumns);
      for (int64_t r = 0; r < m; r += kQuantTileRows)
        quant_i8_rows(w, xq, r, std::min(kQuantTileRows, m - r), col0, col1, scratch.data(), sink);
    }
  });
  return call.out;
}
#endif

// quant_linear (qgemm.h) with the choice of activations: ``is_int8_activations`` quantises x
// per group (this file's kernel; where the build has it and the layout allows it, see
// ``has_int8_activations`` and int8_layout), else float32 activations.
at::Tensor quant_linear_any(const at::Tensor& x, const at::Tensor& codes, int64_t bits,
                            int64_t group, const at::Tensor& group_scale,
                            const c10::optional<at::Tensor>& group_offset,
                            const c10::optional<at::Tensor>& super_scale,
                            const c10::optional<at::Tensor>& super_offset,
                            const c10::optional<at::Tensor>& bias, bool is_scalar,
                            bool is_int8_activations, bool is_tiled) {
  const QuantWeight w =
      quant_weight_of(codes, bits, group, group_scale, group_offset, super_scale, super_offset);
  TORCH_CHECK(is_tiled || (bits != 5 && bits != 6), "5- and 6-bit codes come only in the tiled layout");
  TORCH_CHECK(is_tiled || !w.super_scale_half, "fp16 super scales come only in the tiled layout");
  if (is_tiled) {
#if defined(LLM_SUITE_HAS_QGEMM_LANES)
    TORCH_CHECK(is_int8_activations && !is_scalar, "tiled weights take int8 activations");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                "x must be float32 or bfloat16");
    return quant_linear_lanes(x, w, bias);
#else
    TORCH_CHECK(false, "tiled weights need a build with AVX512-VNNI or AVX2 (not AVX-512 alone)");
#endif
  }
  if (!is_int8_activations) return quant_linear_impl(x, w, bias, is_scalar);
#if defined(LLM_SUITE_HAS_QGEMM_I8)
  TORCH_CHECK(!is_scalar && int8_layout(w),
              "int8 activations need 4-bit codes in groups of 32 or 8-bit codes in groups of "
              "16/32, K a multiple of 32, and the vector kernel");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
#if defined(LLM_SUITE_HAS_QGEMM_VNNI)
  // Batches and prefills of the super-block layouts: one GEMM of vpdpbusd (qgemm_vnni.h).
  if (takes_vnni(x, w)) return quant_linear_vnni(x, w, bias);
#endif
#if defined(LLM_SUITE_HAS_QUANT_PANELS)
  // A prefill's bf16 rows on AVX512-BF16: the weight dequantised to bf16 (qgemm_panels.h).
  if (takes_panels(x, w)) return quant_linear_panels(x, w, bias);
#endif
  // K-quants and GPTQ g128: x per super-block, integer sums across it (qgemm_super.h).
  if (super_layout(w)) return quant_linear_super(x, w, bias);
  return quant_linear_i8(x, w, bias);
#else
  TORCH_CHECK(false, "int8 activations need a build with AVX2 and FMA");
#endif
}

}  // namespace
