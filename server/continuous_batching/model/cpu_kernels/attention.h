// Decode attention straight from the paged K/V cache: one query token per row, keys and values
// read through the row's block table (no gather copy), one pass per row with an online
// softmax (from the row's sliding-window start when it has a window, with optional logit
// soft-capping). One body for every vector ISA (simd.h); the scalar loops below serve head sizes
// and dtypes without a vector pass.
#pragma once

#include "simd.h"

namespace {

#if defined(LLM_SUITE_HAS_SIMD)
// q . k of one head against cache rows, unreduced (W partial sums). float32 caches: FMAs on
// the rows as stored; bfloat16 caches: rows widened to float32 in registers (a 16-bit shift),
// or, where the CPU has AVX512-BF16, vdpbf16ps on the stored bf16 q and k pairs (exact
// products, float32 sums, no conversion pass).
template <class S, typename T, int HD>
struct HeadDot {
  static constexpr int V = HD / S::W;
  typename S::F q[V];
  void load(const T* p) {
    for (int j = 0; j < V; ++j) q[j] = S::load(p + S::W * j);
  }
  typename S::F partial(const T* row) const {
    auto acc = S::mul(q[0], S::load(row));
    for (int j = 1; j < V; ++j) acc = S::fmadd(q[j], S::load(row + S::W * j), acc);
    return acc;
  }
};

#if defined(__AVX512BF16__)
template <int HD>
struct HeadDot<Simd512, c10::BFloat16, HD> {
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

// One sequence's decode attention for kv heads [g0, g1) in ONE pass over its cache rows, with
// an online softmax over chunks of kChunk positions. While the first head of a chunk runs, the
// rows of the next chunk are prefetched into L2: blocks are scattered, so the hardware
// prefetchers lose the stream at every block edge.
template <class S, typename T, int HD>
void decode_sequence(const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                     int64_t k_row, int64_t v_row, int64_t k_head, int64_t v_head, int64_t g0,
                     int64_t g1, int64_t rep, const int32_t* table, int64_t block_size,
                     int64_t first, int64_t len, float scale, float softcap, float* acc,
                     float* run_max, float* run_sum, float* scores, T* out,
                     int64_t out_head_stride) {
  using F = typename S::F;
  constexpr int W = S::W, V = HD / W;
  // Value vectors per pass: a slice of the head that fits the registers with R heads' sums.
  constexpr int VS = V < S::kValueSlice ? V : S::kValueSlice, R = S::kValueRows;
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
  // Positions [first, len): a sliding window starts past 0 (see paged_decode_attention).
  for (int64_t c0 = first; c0 < len; c0 += kChunk) {
    const int64_t n = std::min(kChunk, len - c0);
    const int64_t n_padded = (n + W - 1) / W * W;  // <= kChunk: the score rows' size
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = slot_of(c0 + i);
      k_rows[i] = k_cache + slot * k_row;
      v_rows[i] = v_cache + slot * v_row;
    }
    const int64_t num_ahead = std::max<int64_t>(0, std::min(kChunk, len - c0 - kChunk));
    const int64_t share = (num_ahead + (h1 - h0) - 1) / (h1 - h0);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t g = h / rep;
      HeadDot<S, T, HD> dot;
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
        __m128 s = S::reduce4(dot.partial(k_rows[p] + off), dot.partial(k_rows[p + 1] + off),
                              dot.partial(k_rows[p + 2] + off), dot.partial(k_rows[p + 3] + off));
        if constexpr (kScaleScores) s = _mm_mul_ps(s, _mm_set1_ps(scale));
        _mm_storeu_ps(sh + p, s);
      }
      for (; p < n; ++p) {
        const float s = S::reduce_add(dot.partial(k_rows[p] + g * k_head));
        sh[p] = kScaleScores ? s * scale : s;
      }
      // Soft-capping (Gemma 2): scalar tanh, a pass over n scores per head beside the dots.
      if (softcap > 0.0f)
        for (int64_t i = 0; i < n; ++i) sh[i] = softcap * std::tanh(sh[i] / softcap);
      // The tail up to whole vectors scores -inf: it weighs exp(-87), ~1e-38, and no value
      // row is read for it.
      for (; p < n_padded; ++p) sh[p] = -INFINITY;
      // Online softmax: exponentials against the new running max; what was summed so far is
      // rescaled to it.
      F vmax = S::set1(-INFINITY);
      for (int64_t i = 0; i < n_padded; i += W) vmax = S::max(vmax, S::load(sh + i));
      const float new_max = std::max(run_max[h], S::reduce_max(vmax));
      const F shift = S::set1(new_max);
      F vsum = S::zero();
      for (int64_t i = 0; i < n_padded; i += W) {
        const F e = exp_nonpositive_v<S>(S::sub(S::load(sh + i), shift));
        S::store(sh + i, e);
        vsum = S::add(vsum, e);
      }
      const float correction = exp_nonpositive(run_max[h] - new_max);  // ~0 on the first chunk
      run_sum[h] = run_sum[h] * correction + S::reduce_add(vsum);
      run_max[h] = new_max;
      if (c0 > first && correction != 1.0f) {
        const F c = S::set1(correction);
        for (int j = 0; j < V; ++j) S::store(acc + h * HD + W * j, S::mul(c, S::load(acc + h * HD + W * j)));
      }
    }
    // Values: per kv head, up to R of its query heads' sums over a slice of VS vectors in
    // registers.
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t r0 = 0; r0 < rep; r0 += R) {
        const int64_t nr = std::min<int64_t>(R, rep - r0);
        const int64_t hb = g * rep + r0;
        for (int j0 = 0; j0 < V; j0 += VS) {
          F a[R][VS];
          for (int64_t r = 0; r < nr; ++r)
            for (int j = 0; j < VS; ++j) a[r][j] = S::load(acc + (hb + r) * HD + W * (j0 + j));
          for (int64_t p = 0; p < n; ++p) {
            const T* vp = v_rows[p] + g * v_head + W * j0;
            F v[VS];
            for (int j = 0; j < VS; ++j) v[j] = S::load(vp + W * j);
            for (int64_t r = 0; r < nr; ++r) {
              const F w = S::set1(scores[(hb + r - h0) * kChunk + p]);
              for (int j = 0; j < VS; ++j) a[r][j] = S::fmadd(w, v[j], a[r][j]);
            }
          }
          for (int64_t r = 0; r < nr; ++r)
            for (int j = 0; j < VS; ++j) S::store(acc + (hb + r) * HD + W * (j0 + j), a[r][j]);
        }
      }
    }
  }
  for (int64_t h = h0; h < h1; ++h) {
    const float inv = 1.0f / run_sum[h];
    for (int j = 0; j < HD; ++j) out[h * out_head_stride + j] = from_f32<T>(acc[h * HD + j] * inv);
  }
}
#endif

// Decode attention over the paged cache for every row. Work item = (sequence, kv head): the rep query
// heads sharing that kv head read each K/V row once (grouped-query attention).
template <typename T>
void paged_decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens, int64_t block_size, double scale,
                                 int64_t window, double softcap, at::Tensor& out) {
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
  const float fsoftcap = static_cast<float>(softcap);

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
    // A sliding window keeps the last `window` positions, the row's own included.
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int32_t* table = tables + s * bt_s0;
    const T* qs = qp + s * q_s0;
    T* os = op + s * num_heads * head_dim;
    if (len <= 0) {
      for (int64_t h = g0 * rep; h < g1 * rep; ++h)
        for (int64_t d = 0; d < head_dim; ++d) os[h * head_dim + d] = from_f32<T>(0.0f);
      return;
    }
#if defined(LLM_SUITE_HAS_SIMD)
    constexpr bool kFast = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
    if constexpr (kFast) {
      float* run_max = state.data();
      float* run_sum = state.data() + num_heads;
      switch (head_dim) {
        case 64:
          decode_sequence<Simd, T, 64>(qs, q_s1, kp, vp, kc_s0, vc_s0, kc_s1, vc_s1, g0, g1, rep,
                                       table, block_size, first, len, fscale, fsoftcap,
                                       acc.data(), run_max, run_sum, scores.data(), os, head_dim);
          return;
        case 128:
          decode_sequence<Simd, T, 128>(qs, q_s1, kp, vp, kc_s0, vc_s0, kc_s1, vc_s1, g0, g1, rep,
                                        table, block_size, first, len, fscale, fsoftcap,
                                        acc.data(), run_max, run_sum, scores.data(), os,
                                        head_dim);
          return;
        case 256:  // Gemma's head size
          decode_sequence<Simd, T, 256>(qs, q_s1, kp, vp, kc_s0, vc_s0, kc_s1, vc_s1, g0, g1, rep,
                                        table, block_size, first, len, fscale, fsoftcap,
                                        acc.data(), run_max, run_sum, scores.data(), os,
                                        head_dim);
          return;
        default:
          break;
      }
    }
#endif
    // Portable loops (other head sizes and dtypes): two passes per kv head, scores kept whole.
    const int64_t n = len - first;
    std::vector<float> qf(rep * head_dim), row(head_dim), sums(rep * head_dim), all(rep * n);
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t r = 0; r < rep; ++r) {
        const T* src = qs + (g * rep + r) * q_s1;
        for (int64_t d = 0; d < head_dim; ++d) qf[r * head_dim + d] = to_f32(src[d]) * fscale;
      }
      const T* k_head = kp + g * kc_s1;
      const T* v_head = vp + g * vc_s1;
      for (int64_t p = first; p < len; ++p) {
        const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        load_row(k_head + slot * kc_s0, row.data(), head_dim);
        for (int64_t r = 0; r < rep; ++r) {
          const float sc = dot(qf.data() + r * head_dim, row.data(), head_dim);
          all[r * n + p - first] = fsoftcap > 0.0f ? fsoftcap * std::tanh(sc / fsoftcap) : sc;
        }
      }
      std::vector<float> inv_sum(rep);
      for (int64_t r = 0; r < rep; ++r) {
        float* sr = all.data() + r * n;
        inv_sum[r] = 1.0f / exp_shifted_sum(sr, n, row_max(sr, n));
      }
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t p = first; p < len; ++p) {
        const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        load_row(v_head + slot * vc_s0, row.data(), head_dim);
        for (int64_t r = 0; r < rep; ++r) {
          const float w = all[r * n + p - first];
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
                                  double scale, int64_t window, double softcap) {
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
                                          block_size, scale, window, softcap, out);
  });
  return out;
}

// ---------------------------------------------------------------------------------------
}  // namespace
