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
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;  // one AVX-512 register of floats; two AVX2 registers elsewhere

// Positions per online-softmax chunk of decode attention: its scores of every head stay in L1,
// and the softmax bookkeeping (max, rescale) is paid once per chunk, not per position or block.
constexpr int64_t kChunk = 64;

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

// q . k of one head against cache rows, unreduced (16 partial sums). float32 caches: FMAs on
// the rows as stored. bfloat16 caches, where the CPU has AVX512-BF16: vdpbf16ps multiplies
// the stored bfloat16 q and k pairs exactly and sums in float32, with no conversion pass.
template <typename T, int HD>
struct HeadDot;

template <int HD>
struct HeadDot<float, HD> {
  static constexpr int V = HD / 16;
  __m512 q[V];
  void load(const float* p) {
    for (int j = 0; j < V; ++j) q[j] = _mm512_loadu_ps(p + 16 * j);
  }
  __m512 partial(const float* row) const {
    __m512 acc = _mm512_mul_ps(q[0], _mm512_loadu_ps(row));
    for (int j = 1; j < V; ++j) acc = _mm512_fmadd_ps(q[j], _mm512_loadu_ps(row + 16 * j), acc);
    return acc;
  }
};

#if defined(__AVX512BF16__)
#define LLM_SUITE_FAST_BF16_ATTENTION 1
template <int HD>
struct HeadDot<c10::BFloat16, HD> {
  static constexpr int V = HD / 32;
  __m512bh q[V];
  void load(const c10::BFloat16* p) {
    for (int j = 0; j < V; ++j) q[j] = (__m512bh)_mm512_loadu_si512(p + 32 * j);
  }
  __m512 partial(const c10::BFloat16* row) const {
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j < V; ++j)
      acc = _mm512_dpbf16_ps(acc, q[j], (__m512bh)_mm512_loadu_si512(row + 32 * j));
    return acc;
  }
};
#endif

// exp(x) of 16 lanes, x <= 0: exp_nonpositive above, lane-wise.
inline __m512 exp512_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// One sequence's decode attention for kv heads [g0, g1) in ONE pass over its cache rows, with
// an online softmax over chunks of kChunk positions. While the first head of a chunk runs, the
// rows of the next chunk are prefetched into L2: blocks are scattered, so the hardware
// prefetchers lose the stream at every block edge.
template <typename T, int HD>
void decode_sequence_avx512(const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                            int64_t k_row, int64_t v_row, int64_t k_head, int64_t v_head,
                            int64_t num_kv_heads, int64_t g0, int64_t g1, int64_t rep,
                            const int32_t* table, int64_t block_size, int64_t len, float scale,
                            float* acc, float* run_max, float* run_sum, float* scores, T* out,
                            int64_t out_head_stride) {
  constexpr int V = HD / 16;
  const int64_t h0 = g0 * rep, h1 = g1 * rep;
  // With float32 caches q is pre-scaled; bfloat16 q stays as stored and scores are scaled.
  constexpr bool kScaleScores = !std::is_same_v<T, float>;
  alignas(64) float q_scaled[HD];
  const T* k_rows[kChunk];
  const T* v_rows[kChunk];
  for (int64_t h = h0; h < h1; ++h) {
    run_max[h] = -INFINITY;
    run_sum[h] = 0.0f;
    for (int j = 0; j < HD; ++j) acc[h * HD + j] = 0.0f;
  }
  // Bytes of the kv heads [g0, g1) in one cache row (contiguous when the heads are).
  const char* k_base = reinterpret_cast<const char*>(k_cache + g0 * k_head);
  const char* v_base = reinterpret_cast<const char*>(v_cache + g0 * v_head);
  const int64_t k_bytes = (g1 - g0) * k_head * static_cast<int64_t>(sizeof(T));
  const int64_t v_bytes = (g1 - g0) * v_head * static_cast<int64_t>(sizeof(T));
  auto slot_of = [&](int64_t p) {
    return static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
  };
  for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
    const int64_t n = std::min(kChunk, len - c0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = slot_of(c0 + i);
      k_rows[i] = k_cache + slot * k_row;
      v_rows[i] = v_cache + slot * v_row;
    }
    const int64_t num_ahead = std::max<int64_t>(0, std::min(kChunk, len - c0 - kChunk));
    const int64_t share = (num_ahead + (h1 - h0) - 1) / (h1 - h0);
    const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1u);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t g = h / rep;
      HeadDot<T, HD> dot;
      if constexpr (kScaleScores) {
        dot.load(q + h * q_head_stride);
      } else {
        for (int j = 0; j < HD; ++j) q_scaled[j] = to_f32(q[h * q_head_stride + j]) * scale;
        dot.load(reinterpret_cast<const T*>(q_scaled));
      }
      float* sh = scores + (h - h0) * kChunk;
      int64_t p = 0;
      // This head's share of the next chunk's rows, one row per four positions scored: a
      // burst of prefetches would overflow the miss queue and be dropped.
      const int64_t share_begin = (h - h0) * share, share_end = std::min(num_ahead, share_begin + share);
      for (; p + 4 <= n; p += 4) {
        if (const int64_t i = share_begin + p / 4; i < share_end) {
          const int64_t slot = slot_of(c0 + kChunk + i);
          for (int64_t o = 0; o < k_bytes; o += 64)
            _mm_prefetch(k_base + slot * k_row * sizeof(T) + o, _MM_HINT_T1);
          for (int64_t o = 0; o < v_bytes; o += 64)
            _mm_prefetch(v_base + slot * v_row * sizeof(T) + o, _MM_HINT_T1);
        }
        const int64_t off = g * k_head;
        __m128 s = reduce4(dot.partial(k_rows[p] + off), dot.partial(k_rows[p + 1] + off),
                           dot.partial(k_rows[p + 2] + off), dot.partial(k_rows[p + 3] + off));
        if constexpr (kScaleScores) s = _mm_mul_ps(s, _mm_set1_ps(scale));
        _mm_storeu_ps(sh + p, s);
      }
      for (; p < n; ++p) {
        const float s = _mm512_reduce_add_ps(dot.partial(k_rows[p] + g * k_head));
        sh[p] = kScaleScores ? s * scale : s;
      }
      // Online softmax: exponentials against the new running max; what was summed so far is
      // rescaled to it.
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sh + i));
      if (i < n) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, sh + i));
      const float new_max = std::max(run_max[h], _mm512_reduce_max_ps(vmax));
      const __m512 shift = _mm512_set1_ps(new_max);
      __m512 vsum = _mm512_setzero_ps();
      for (i = 0; i + 16 <= n; i += 16) {
        const __m512 e = exp512_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sh + i), shift));
        _mm512_storeu_ps(sh + i, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      if (i < n) {
        const __m512 e = exp512_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sh + i), shift));
        _mm512_mask_storeu_ps(sh + i, tail, e);
        vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
      }
      const float correction = exp_nonpositive(run_max[h] - new_max);  // ~0 on the first chunk
      run_sum[h] = run_sum[h] * correction + _mm512_reduce_add_ps(vsum);
      run_max[h] = new_max;
      if (c0 > 0 && correction != 1.0f) {
        const __m512 c = _mm512_set1_ps(correction);
        for (int j = 0; j < V; ++j)
          _mm512_storeu_ps(acc + h * HD + 16 * j, _mm512_mul_ps(c, _mm512_loadu_ps(acc + h * HD + 16 * j)));
      }
    }
    // Values: per kv head, up to four of its query heads' sums in registers.
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t r0 = 0; r0 < rep; r0 += 4) {
        const int64_t nr = std::min<int64_t>(4, rep - r0);
        const int64_t hb = g * rep + r0;
        __m512 a[4][V];
        for (int64_t r = 0; r < nr; ++r)
          for (int j = 0; j < V; ++j) a[r][j] = _mm512_loadu_ps(acc + (hb + r) * HD + 16 * j);
        for (int64_t p = 0; p < n; ++p) {
          const T* vp = v_rows[p] + g * v_head;
          __m512 v[V];
          for (int j = 0; j < V; ++j) v[j] = load16(vp + 16 * j);
          for (int64_t r = 0; r < nr; ++r) {
            const __m512 w = _mm512_set1_ps(scores[(hb + r - h0) * kChunk + p]);
            for (int j = 0; j < V; ++j) a[r][j] = _mm512_fmadd_ps(w, v[j], a[r][j]);
          }
        }
        for (int64_t r = 0; r < nr; ++r)
          for (int j = 0; j < V; ++j) _mm512_storeu_ps(acc + (hb + r) * HD + 16 * j, a[r][j]);
      }
    }
  }
  for (int64_t h = h0; h < h1; ++h) {
    const float inv = 1.0f / run_sum[h];
    for (int j = 0; j < HD; ++j) out[h * out_head_stride + j] = from_f32<T>(acc[h * HD + j] * inv);
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

  // Work items: whole sequences (each block's rows read as one contiguous stretch) when there
  // are enough of them to keep every thread busy, else (sequence, kv head) pairs. Longest
  // first, handed out one at a time, so that one long context does not land last on a thread.
  const int64_t num_threads = at::get_num_threads();
  const int64_t heads_per_item = num_seqs >= 2 * num_threads ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  const int64_t num_items = num_seqs * items_per_seq;
  std::vector<int64_t> order(num_items);
  for (int64_t i = 0; i < num_items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return lens[a / items_per_seq] > lens[b / items_per_seq];
  });
  std::atomic<int64_t> next{0};

  auto run_item = [&](int64_t item, std::vector<float>& acc, std::vector<float>& state,
                      std::vector<float>& scores) {
    const int64_t s = item / items_per_seq;
    const int64_t g0 = (item % items_per_seq) * heads_per_item, g1 = g0 + heads_per_item;
    const int64_t len = lens[s];
    const int32_t* table = tables + s * bt_s0;
    const T* qs = qp + s * q_s0;
    T* os = op + s * num_heads * head_dim;
    if (len <= 0) {
      for (int64_t h = g0 * rep; h < g1 * rep; ++h)
        for (int64_t d = 0; d < head_dim; ++d) os[h * head_dim + d] = from_f32<T>(0.0f);
      return;
    }
#if defined(__AVX512F__)
    constexpr bool kFast = std::is_same_v<T, float>
#if defined(LLM_SUITE_FAST_BF16_ATTENTION)
                           || std::is_same_v<T, c10::BFloat16>
#endif
        ;
    if constexpr (kFast) {
      float* run_max = state.data();
      float* run_sum = state.data() + num_heads;
      switch (head_dim) {
        case 64:
          decode_sequence_avx512<T, 64>(qs, q_s1, kp, vp, kc_s0, vc_s0, kc_s1, vc_s1,
                                        num_kv_heads, g0, g1, rep, table, block_size, len, fscale,
                                        acc.data(), run_max, run_sum, scores.data(), os, head_dim);
          return;
        case 128:
          decode_sequence_avx512<T, 128>(qs, q_s1, kp, vp, kc_s0, vc_s0, kc_s1, vc_s1,
                                         num_kv_heads, g0, g1, rep, table, block_size, len, fscale,
                                         acc.data(), run_max, run_sum, scores.data(), os, head_dim);
          return;
        default:
          break;
      }
    }
#endif
    // Portable loops (other head sizes and dtypes): two passes per kv head, scores kept whole.
    std::vector<float> qf(rep * head_dim), row(head_dim), sums(rep * head_dim), all(rep * len);
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t r = 0; r < rep; ++r) {
        const T* src = qs + (g * rep + r) * q_s1;
        for (int64_t d = 0; d < head_dim; ++d) qf[r * head_dim + d] = to_f32(src[d]) * fscale;
      }
      const T* k_head = kp + g * kc_s1;
      const T* v_head = vp + g * vc_s1;
      for (int64_t p = 0; p < len; ++p) {
        const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        load_row(k_head + slot * kc_s0, row.data(), head_dim);
        for (int64_t r = 0; r < rep; ++r)
          all[r * len + p] = dot(qf.data() + r * head_dim, row.data(), head_dim);
      }
      std::vector<float> inv_sum(rep);
      for (int64_t r = 0; r < rep; ++r) {
        float* sr = all.data() + r * len;
        inv_sum[r] = 1.0f / exp_shifted_sum(sr, len, row_max(sr, len));
      }
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t p = 0; p < len; ++p) {
        const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        load_row(v_head + slot * vc_s0, row.data(), head_dim);
        for (int64_t r = 0; r < rep; ++r) {
          const float w = all[r * len + p];
          float* a = sums.data() + r * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += w * row[d];
        }
      }
      for (int64_t r = 0; r < rep; ++r) {
        T* dst = os + (g * rep + r) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_f32<T>(sums[r * head_dim + d] * inv_sum[r]);
      }
    }
  };

  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(num_heads * head_dim), state(2 * num_heads),
        scores(num_heads * kChunk);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1))
      run_item(order[i], acc, state, scores);
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
// dst = RMSNorm(x) * w for one float32 row, rounded once to W.
template <typename W>
inline void write_rms_normed(const float* x, const float* w, int64_t n, double eps, W* dst) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / n + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) dst[i] = from_f32<W>(x[i] * inv * w[i]);
}

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
      write_rms_normed(xf.data(), wf.data(), n, eps, op + t * n);
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

// x += delta (float32 residual stream, in place), then the RMSNorm of x in the weight's dtype:
// the residual add of a 16-bit model's layer output and the next norm in one pass over x.
template <typename D, typename W>
void add_rms_norm_impl(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps,
                       at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), ds = delta.stride(0);
  float* xp = x.data_ptr<float>();
  const D* dp = delta.data_ptr<D>();
  const W* wp = weight.data_ptr<W>();
  W* op = out.data_ptr<W>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> df(n), wf(n);
    load_row(wp, wf.data(), n);
    for (int64_t t = begin; t < end; ++t) {
      float* xr = xp + t * xs;
      load_row(dp + t * ds, df.data(), n);
      for (int64_t i = 0; i < n; ++i) xr[i] += df[i];
      write_rms_normed(xr, wf.data(), n, eps, op + t * n);
    }
  });
}

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x (the residual stream) must be float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && delta.dim() == 2 && delta.stride(1) == 1 &&
                  weight.is_contiguous(),
              "x and delta must be [T, N] rows");
  TORCH_CHECK(delta.sizes() == x.sizes() && weight.numel() == x.size(1), "shapes");
  auto out = at::empty({x.size(0), x.size(1)}, x.options().dtype(weight.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), "arms_w", [&] {
    using W = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, delta.scalar_type(), "arms_d", [&] {
      add_rms_norm_impl<scalar_t, W>(x, delta, weight, eps, out);
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

// ---------------------------------------------------------------------------------------
// Float32 logits of a 16-bit lm_head output [n, V], with each row's best k candidates
// recomputed exactly (hidden [n, H] float32 . weight rows [V, H]): one pass that widens the row
// and keeps its top k (a running threshold: a candidate is inserted only when it beats the
// k-th best), then k dot products. Replaces .float(), topk, index_select, bmm and scatter_.
// Among equal logits the first index wins.
template <typename T>
void refine_logits_impl(const at::Tensor& logits, const at::Tensor& hidden,
                        const at::Tensor& weight, int64_t k, at::Tensor& out) {
  const int64_t n = logits.size(0), vocab = logits.size(1), h = hidden.size(1);
  const T* lp = logits.data_ptr<T>();
  const float* hp = hidden.data_ptr<float>();
  const T* wp = weight.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const int64_t l_s0 = logits.stride(0), h_s0 = hidden.stride(0), w_s0 = weight.stride(0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> top_v(k), w_row(h);
    std::vector<int64_t> top_i(k);
    for (int64_t r = begin; r < end; ++r) {
      const T* src = lp + r * l_s0;
      float* dst = op + r * vocab;
      int64_t num_top = 0;
      float threshold = -INFINITY;  // the k-th best so far, once k are held
      auto offer = [&](float v, int64_t i) {
        if (num_top == k && !(v > threshold)) return;
        int64_t at = num_top < k ? num_top++ : k - 1;
        while (at > 0 && v > top_v[at - 1]) {  // keep descending order, ties by first index
          top_v[at] = top_v[at - 1];
          top_i[at] = top_i[at - 1];
          --at;
        }
        top_v[at] = v;
        top_i[at] = i;
        if (num_top == k) threshold = top_v[k - 1];
      };
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (; i + 16 <= vocab; i += 16) {
          const __m512 x = load16(src + i);
          _mm512_storeu_ps(dst + i, x);
          // NaN never passes (ordered compare), as in the scalar tail.
          __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(threshold), _CMP_GT_OQ);
          if (num_top < k) over = 0xFFFF;
          while (over) {
            const int lane = __builtin_ctz(over);
            over &= over - 1;
            offer(dst[i + lane], i + lane);
          }
        }
      }
#endif
      for (; i < vocab; ++i) {
        dst[i] = to_f32(src[i]);
        offer(dst[i], i);
      }
      const float* hr = hp + r * h_s0;
      for (int64_t j = 0; j < num_top; ++j) {
        load_row(wp + top_i[j] * w_s0, w_row.data(), h);
        dst[top_i[j]] = dot(hr, w_row.data(), h);
      }
    }
  });
}

at::Tensor refine_logits(const at::Tensor& logits, const at::Tensor& hidden,
                         const at::Tensor& weight, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && hidden.dim() == 2 && weight.dim() == 2, "bad ranks");
  TORCH_CHECK(logits.stride(1) == 1 && hidden.stride(1) == 1 && weight.stride(1) == 1,
              "rows must be contiguous");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat, "hidden must be float32");
  TORCH_CHECK(logits.scalar_type() == weight.scalar_type(), "logits and weight share a dtype");
  TORCH_CHECK(logits.size(0) == hidden.size(0) && logits.size(1) == weight.size(0) &&
                  hidden.size(1) == weight.size(1),
              "shapes: logits [n, V], hidden [n, H], weight [V, H]");
  TORCH_CHECK(k >= 1, "k >= 1");
  auto out = at::empty({logits.size(0), logits.size(1)}, logits.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "refine", [&] {
    refine_logits_impl<scalar_t>(logits, hidden, weight, std::min(k, logits.size(1)), out);
  });
  return out;
}

// ---------------------------------------------------------------------------------------
// bfloat16 matmul for the decoder's linear layers (x [M, K] . W[N, K]^T + bias -> [M, N]):
// AVX512-BF16 dot products of bf16 pairs (exact products, float32 sums, one rounding). The
// weight is packed once, column blocks of 16 with each K pair of them in one zmm:
// [ceil(N/16), ceil(K/2), 16, 2], zero padded. A register tile of kGemmRows rows x kGemmBlocks
// blocks keeps its sums in 24 registers; threads split the column blocks. Measured here
// against oneDNN's prepacked matmul (bf16, 2 threads): 1.1-1.2x at 32 rows, 1.6-3x at 1 row
// (oneDNN's per-call cost is ~15 us), even at 256 rows.
#if defined(__AVX512BF16__)
constexpr bool kHasBf16Gemm = true;
constexpr int64_t kColBlock = 16;
constexpr int kGemmRows = 4, kGemmBlocks = 6;

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

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be [M, K] bfloat16 rows");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous(), "packed weight expected");
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
  const uint16_t* a = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const __m512bh* b = reinterpret_cast<const __m512bh*>(packed.data_ptr<at::BFloat16>());
  uint16_t* c = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t lda = x.stride(0);
  constexpr int MR = kGemmRows, NV = kGemmBlocks;
  const int64_t num_groups = (nb + NV - 1) / NV;
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t j = g * NV;
      if (j + NV > nb) {  // the last, narrower group: one block at a time
        for (int64_t jj = j; jj < nb; ++jj)
          for (int64_t r = 0; r < m; r += MR)
            gemm_tile<MR, 1, false>(a + r * lda, lda, b + jj * kp, kp, k, bp, n, jj * kColBlock,
                                    c + r * n, n, std::min<int64_t>(MR, m - r));
        continue;
      }
      for (int64_t r = 0; r < m; r += MR) {
        const int64_t rows = std::min<int64_t>(MR, m - r);
        if (rows == MR)
          gemm_tile<MR, NV, true>(a + r * lda, lda, b + j * kp, kp, k, bp, n, j * kColBlock,
                                  c + r * n, n, rows);
        else
          gemm_tile<MR, NV, false>(a + r * lda, lda, b + j * kp, kp, k, bp, n, j * kColBlock,
                                   c + r * n, n, rows);
      }
    }
  });
  return out;
}
#else
constexpr bool kHasBf16Gemm = false;
at::Tensor pack_bf16_weight(const at::Tensor&) { TORCH_CHECK(false, "built without AVX512-BF16"); }
at::Tensor bf16_linear(const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention from the paged KV cache (q [T,H,D] -> [T,H,D])");
  m.def("rms_norm", &rms_norm, "RMSNorm of [T,N] rows, output in the weight's dtype");
  m.def("add_rms_norm", &add_rms_norm, "x += delta (float32 x, in place), then RMSNorm of x");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up of [T,2I] -> [T,I]");
  m.def("rope_write_kv", &rope_write_kv, "rotate q/k of fused qkv, write k/v to cache slots");
  m.attr("has_bf16_gemm") = kHasBf16Gemm;
  m.def("pack_bf16_weight", &pack_bf16_weight, "W [N,K] bf16 -> the layout bf16_linear reads");
  m.def("bf16_linear", &bf16_linear, "x [M,K] bf16 . W^T (+ bias) from a packed W -> [M,N] bf16",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("refine_logits", &refine_logits,
        "float32 logits of a 16-bit lm_head output, each row's top k recomputed exactly");
}
