// Fused CPU kernels of the CB engine's decoder (see __init__.py for how they are built and
// chosen). Every kernel computes in float32 and rounds once to the output dtype; loops are
// written so that g++ -O3 -march=native vectorises them (independent lanes, no branches), which
// keeps one source for any x86-64 or aarch64 machine while using AVX-512 where it exists.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;  // one AVX-512 register of floats; two AVX2 registers elsewhere

inline float to_f32(float v) { return v; }
inline float to_f32(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_f32(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T from_f32(float v) { return static_cast<T>(v); }  // c10 rounds to nearest even

// Row of n elements -> float32 (vectorises to shifts for bfloat16).
template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}

// exp(x) for x <= 0 (softmax after subtracting the max; SiLU on -|x|) with a relative error
// below 2e-7: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial, 2^n built in the
// exponent bits. Branch-free so that loops over it vectorise (libm's expf does not).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this expf underflows to denormals; treat as ~0
  // Round to nearest by the 1.5 * 2^23 trick: plain arithmetic, which vectorises where
  // nearbyint (a libm call without -ffast-math) does not.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// max(x[0..n)) with independent lanes (a plain running max does not vectorise).
inline float row_max(const float* __restrict x, int64_t n) {
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = -INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = lanes[l] > x[i + l] ? lanes[l] : x[i + l];
  float m = -INFINITY;
  for (; i < n; ++i) m = std::max(m, x[i]);
  for (int l = 0; l < kLanes; ++l) m = std::max(m, lanes[l]);
  return m;
}

// x[i] = exp(x[i] - shift) in place (x[i] <= shift); returns their sum. Two loops, so that the
// exponentials vectorise and the sum keeps independent lanes.
inline float exp_shifted_sum(float* __restrict x, int64_t n, float shift) {
  for (int64_t i = 0; i < n; ++i) x[i] = exp_nonpositive(x[i] - shift);
  float lanes[kLanes] = {0.0f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[i + l];
  float sum = 0.0f;
  for (; i < n; ++i) sum += x[i];
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[kLanes] = {0.0f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float sum = 0.0f;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

#if defined(__AVX512F__)
// Sixteen elements -> float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The two passes of one (sequence, kv head) item with the head kept in registers: head_dim is
// HD (a multiple of 16). Scores are rep x len, row-major; the values pass weighs V rows by
// them into out [rep, HD]. Four query heads at a time keep q (or the sums) in registers.
// Rows this many positions ahead are prefetched: blocks are scattered, so the hardware
// prefetchers lose the stream at every block edge and the passes would wait on memory.
constexpr int64_t kPrefetchAhead = 8;

template <typename T>
inline const char* cache_row(const T* base, int64_t row_stride, const int32_t* table,
                             int64_t block_size, int64_t p) {
  const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
  return reinterpret_cast<const char*>(base + slot * row_stride);
}

template <int BYTES>
inline void prefetch_row(const char* row, int hint) {
  for (int offset = 0; offset < BYTES; offset += 64) {
    if (hint == 0) _mm_prefetch(row + offset, _MM_HINT_T0);
    else _mm_prefetch(row + offset, _MM_HINT_T1);
  }
}

// Four dot-product accumulators -> their four sums in one vector (lane i = sum of x_i's lanes):
// about a third of the instructions of four separate horizontal reductions.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then [a, b, c, d] partial sums.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), upper);
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

template <typename T, int HD>
void decode_scores_avx512(const float* qf, int64_t rep, const T* kp, int64_t k_row,
                          const T* vp, int64_t v_row, const int32_t* table, int64_t block_size,
                          int64_t len, float* scores) {
  constexpr int V = HD / 16;
  constexpr int kRowBytes = HD * sizeof(T);
  alignas(64) float kf[4][HD];  // four positions' keys in float32, reused by every head
  for (int64_t r0 = 0; r0 < rep; r0 += 4) {
    const int64_t nr = std::min<int64_t>(4, rep - r0);
    __m512 q[4][V];
    for (int64_t r = 0; r < nr; ++r)
      for (int j = 0; j < V; ++j) q[r][j] = _mm512_loadu_ps(qf + (r0 + r) * HD + 16 * j);
    int64_t p = 0;
    for (; p + 4 <= len; p += 4) {
      for (int i = 0; i < 4; ++i) {
        const int64_t ahead = p + i + kPrefetchAhead;
        if (r0 == 0 && ahead < len) {
          // K now, V for the values pass (to L2) while the K stream is running anyway.
          prefetch_row<kRowBytes>(cache_row(kp, k_row, table, block_size, ahead), 0);
          prefetch_row<kRowBytes>(cache_row(vp, v_row, table, block_size, ahead), 1);
        }
        const T* row = reinterpret_cast<const T*>(cache_row(kp, k_row, table, block_size, p + i));
        for (int j = 0; j < V; ++j) _mm512_store_ps(kf[i] + 16 * j, load16(row + 16 * j));
      }
      for (int64_t r = 0; r < nr; ++r) {
        __m512 acc[4];
        for (int i = 0; i < 4; ++i) {
          acc[i] = _mm512_mul_ps(q[r][0], _mm512_load_ps(kf[i]));
          for (int j = 1; j < V; ++j)
            acc[i] = _mm512_fmadd_ps(q[r][j], _mm512_load_ps(kf[i] + 16 * j), acc[i]);
        }
        _mm_storeu_ps(scores + (r0 + r) * len + p, reduce4(acc[0], acc[1], acc[2], acc[3]));
      }
    }
    for (; p < len; ++p) {  // the last len % 4 positions, one at a time
      const T* row = reinterpret_cast<const T*>(cache_row(kp, k_row, table, block_size, p));
      __m512 k[V];
      for (int j = 0; j < V; ++j) k[j] = load16(row + 16 * j);
      for (int64_t r = 0; r < nr; ++r) {
        __m512 acc = _mm512_mul_ps(q[r][0], k[0]);
        for (int j = 1; j < V; ++j) acc = _mm512_fmadd_ps(q[r][j], k[j], acc);
        scores[(r0 + r) * len + p] = _mm512_reduce_add_ps(acc);
      }
    }
  }
}

template <typename T, int HD>
void decode_values_avx512(const float* scores, int64_t rep, const T* vp, int64_t v_row,
                          const int32_t* table, int64_t block_size, int64_t len, float* out) {
  constexpr int V = HD / 16;
  for (int64_t r0 = 0; r0 < rep; r0 += 4) {
    const int64_t nr = std::min<int64_t>(4, rep - r0);
    __m512 acc[4][V];
    for (int64_t r = 0; r < nr; ++r)
      for (int j = 0; j < V; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < len; ++p) {
      if (r0 == 0 && p + kPrefetchAhead < len)
        prefetch_row<HD * sizeof(T)>(cache_row(vp, v_row, table, block_size, p + kPrefetchAhead), 0);
      const T* row = reinterpret_cast<const T*>(cache_row(vp, v_row, table, block_size, p));
      __m512 v[V];
      for (int j = 0; j < V; ++j) v[j] = load16(row + 16 * j);
      for (int64_t r = 0; r < nr; ++r) {
        const __m512 w = _mm512_set1_ps(scores[(r0 + r) * len + p]);
        for (int j = 0; j < V; ++j) acc[r][j] = _mm512_fmadd_ps(w, v[j], acc[r][j]);
      }
    }
    for (int64_t r = 0; r < nr; ++r)
      for (int j = 0; j < V; ++j) _mm512_storeu_ps(out + (r0 + r) * HD + 16 * j, acc[r][j]);
  }
}
#endif

// ---------------------------------------------------------------------------------------
// Decode attention straight from the paged cache: one query token per sequence, keys and values
// read through its block table (no gather copy). Work item = (sequence, kv head): the rep query
// heads sharing that kv head read each K/V row once (grouped-query attention).
template <typename T>
void paged_decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens, int64_t block_size, double scale,
                                 at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), rep = num_heads / num_kv_heads;
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t kc_s0 = k_cache.stride(0), kc_s1 = k_cache.stride(1);
  const int64_t vc_s0 = v_cache.stride(0), vc_s1 = v_cache.stride(1);
  const int64_t bt_s0 = block_tables.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  // The AVX-512 passes for the usual head sizes; false: run the portable loops.
  auto score_pass = [head_dim](const float* qf, int64_t rep, const T* k, int64_t k_row,
                               const T* v, int64_t v_row, const int32_t* table, int64_t bs,
                               int64_t len, float* scores) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
      switch (head_dim) {
        case 64: decode_scores_avx512<T, 64>(qf, rep, k, k_row, v, v_row, table, bs, len, scores); return true;
        case 128: decode_scores_avx512<T, 128>(qf, rep, k, k_row, v, v_row, table, bs, len, scores); return true;
        default: break;
      }
    }
#endif
    return false;
  };
  auto value_pass = [head_dim](const float* scores, int64_t rep, const T* v, int64_t v_row,
                               const int32_t* table, int64_t bs, int64_t len, float* out) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
      switch (head_dim) {
        case 64: decode_values_avx512<T, 64>(scores, rep, v, v_row, table, bs, len, out); return true;
        case 128: decode_values_avx512<T, 128>(scores, rep, v, v_row, table, bs, len, out); return true;
        default: break;
      }
    }
#endif
    return false;
  };

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rep * head_dim), row(head_dim), acc(rep * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, g = item % num_kv_heads;
      const int64_t len = lens[s];
      const int32_t* table = tables + s * bt_s0;
      for (int64_t r = 0; r < rep; ++r) {
        const T* src = qp + s * q_s0 + (g * rep + r) * q_s1;
        for (int64_t d = 0; d < head_dim; ++d) qf[r * head_dim + d] = to_f32(src[d]) * fscale;
      }
      scores.resize(rep * len);
      const T* k_head = kp + g * kc_s1;
      const T* v_head = vp + g * vc_s1;
      if (!score_pass(qf.data(), rep, k_head, kc_s0, v_head, vc_s0, table, block_size, len,
                      scores.data())) {
        for (int64_t p = 0; p < len; ++p) {
          const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
          load_row(k_head + slot * kc_s0, row.data(), head_dim);
          for (int64_t r = 0; r < rep; ++r)
            scores[r * len + p] = dot(qf.data() + r * head_dim, row.data(), head_dim);
        }
      }
      std::vector<float> inv_sum(rep);
      for (int64_t r = 0; r < rep; ++r) {
        float* sr = scores.data() + r * len;
        inv_sum[r] = 1.0f / exp_shifted_sum(sr, len, row_max(sr, len));
      }
      if (!value_pass(scores.data(), rep, v_head, vc_s0, table, block_size, len, acc.data())) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t p = 0; p < len; ++p) {
          const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
          load_row(v_head + slot * vc_s0, row.data(), head_dim);
          for (int64_t r = 0; r < rep; ++r) {
            const float w = scores[r * len + p];
            float* a = acc.data() + r * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] += w * row[d];
          }
        }
      }
      for (int64_t r = 0; r < rep; ++r) {
        T* dst = op + (s * num_heads + g * rep + r) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_f32<T>(acc[r * head_dim + d] * inv_sum[r]);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, int64_t block_size,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && context_lens.is_contiguous(), "tables not contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    paged_decode_attention_impl<scalar_t>(q, k_cache, v_cache, block_tables, context_lens,
                                          block_size, scale, out);
  });
  return out;
}

// ---------------------------------------------------------------------------------------
// RMSNorm of the residual stream x [T, N] (float32 or the model dtype) with weight [N], written
// in the weight's dtype: one pass instead of torch's pow/mean/rsqrt/mul/mul/cast.
template <typename X, typename W>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const X* xp = x.data_ptr<X>();
  const W* wp = weight.data_ptr<W>();
  W* op = out.data_ptr<W>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(n), wf(n);
    load_row(wp, wf.data(), n);
    for (int64_t t = begin; t < end; ++t) {
      load_row(xp + t * xs, xf.data(), n);
      const float inv = 1.0f / std::sqrt(dot(xf.data(), xf.data(), n) / n + static_cast<float>(eps));
      W* dst = op + t * n;
      for (int64_t i = 0; i < n; ++i) dst[i] = from_f32<W>(xf[i] * inv * wf[i]);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous(), "x must be [T, N] rows");
  TORCH_CHECK(weight.numel() == x.size(1), "weight size");
  auto out = at::empty({x.size(0), x.size(1)}, x.options().dtype(weight.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), "rms_w", [&] {
    using W = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_x", [&] {
      rms_norm_impl<scalar_t, W>(x, weight, eps, out);
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------
// SiLU(gate) * up for the fused gate_up output [T, 2I] -> [T, I].
template <typename T>
void silu_and_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, gs = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> g(inter), u(inter);
    for (int64_t t = begin; t < end; ++t) {
      load_row(gp + t * gs, g.data(), inter);
      load_row(gp + t * gs + inter, u.data(), inter);
      T* dst = op + t * inter;
      for (int64_t i = 0; i < inter; ++i) {
        // sigmoid(x) from exp(-|x|) only: no overflow for either sign.
        const float e = exp_nonpositive(-std::fabs(g[i]));
        const float sig = g[i] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        dst[i] = from_f32<T>(g[i] * sig * u[i]);
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I] rows");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu", [&] {
    silu_and_mul_impl<scalar_t>(gate_up, out);
  });
  return out;
}

// ---------------------------------------------------------------------------------------
// RoPE ("rotate half" with the sign folded into sin) on q and k of the fused qkv output
// [T, (H + 2 KVH) * D], then the step's k and v written to their cache slots. Returns the
// rotated q [T, H, D]; replaces flip/mul/addcmul and two index_copy_ per layer.
template <typename T>
void rope_write_kv_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                        int64_t num_heads, at::Tensor& q_out) {
  const int64_t tokens = qkv.size(0), head_dim = k_cache.size(2), kvh = k_cache.size(1);
  const int64_t half = head_dim / 2, qs = qkv.stride(0);
  const int64_t kc_s0 = k_cache.stride(0), kc_s1 = k_cache.stride(1);
  const int64_t vc_s0 = v_cache.stride(0), vc_s1 = v_cache.stride(1);
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* kp = k_cache.data_ptr<T>();
  T* vp = v_cache.data_ptr<T>();
  T* qp = q_out.data_ptr<T>();
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> c(head_dim), s(head_dim), x(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      load_row(cp + t * cos.stride(0), c.data(), head_dim);
      load_row(sp + t * sin.stride(0), s.data(), head_dim);
      const T* row = src + t * qs;
      for (int64_t h = 0; h < num_heads + kvh; ++h) {
        load_row(row + h * head_dim, x.data(), head_dim);
        T* dst = h < num_heads ? qp + (t * num_heads + h) * head_dim
                               : kp + slot[t] * kc_s0 + (h - num_heads) * kc_s1;
        for (int64_t d = 0; d < half; ++d) {
          dst[d] = from_f32<T>(x[d] * c[d] + x[d + half] * s[d]);
          dst[d + half] = from_f32<T>(x[d + half] * c[d + half] + x[d] * s[d + half]);
        }
      }
      const T* v = row + (num_heads + kvh) * head_dim;
      for (int64_t h = 0; h < kvh; ++h)
        std::memcpy(vp + slot[t] * vc_s0 + h * vc_s1, v + h * head_dim, head_dim * sizeof(T));
    }
  });
}

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                         int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, width] rows");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.stride(1) == 1 && sin.stride(1) == 1,
              "cos/sin must be [T, D] rows");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1, "cache rows must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be int64");
  const int64_t head_dim = k_cache.size(2), kvh = k_cache.size(1);
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) == (num_heads + 2 * kvh) * head_dim, "qkv width");
  TORCH_CHECK(cos.size(1) == head_dim && cos.size(0) == qkv.size(0), "cos rows");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && qkv.scalar_type() == cos.scalar_type(),
              "qkv, cos/sin and the caches must share a dtype");
  auto q = at::empty({qkv.size(0), num_heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope", [&] {
    rope_write_kv_impl<scalar_t>(qkv, cos, sin, k_cache, v_cache, slots, num_heads, q);
  });
  return q;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention from the paged KV cache (q [T,H,D] -> [T,H,D])");
  m.def("rms_norm", &rms_norm, "RMSNorm of [T,N] rows, output in the weight's dtype");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up of [T,2I] -> [T,I]");
  m.def("rope_write_kv", &rope_write_kv, "rotate q/k of fused qkv, write k/v to cache slots");
}
