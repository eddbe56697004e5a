// Decode attention straight from the paged K/V cache: one query token per row, keys and values
// read through the row's block table (no gather copy), one pass per row with an online
// softmax (from the row's sliding-window start when it has a window, with optional logit
// soft-capping). One body for every vector ISA (simd.h); the scalar loops below serve head sizes
// and dtypes without a vector pass.
#pragma once

#include "simd.h"

namespace {

// One work item of decode attention: a sequence's kv heads [g0, g1) and their query heads.
template <typename T>
struct DecodeItem {
  const T* q;  // the sequence's query row; head h at q + h * q_head_stride
  int64_t q_head_stride;
  const T* k_cache;
  const T* v_cache;
  int64_t k_row, v_row, k_head, v_head;  // cache strides: per slot, per kv head
  int64_t g0, g1, rep;
  const int32_t* table;
  int64_t block_size;
  int64_t first, len;  // positions [first, len): a sliding window starts past 0
  float scale, softcap;
  T* out;  // head h at out + h * out_head_stride
  int64_t out_head_stride;
};

// Per-thread scratch of decode attention, sized for every head of a sequence.
struct DecodeScratch {
  std::vector<float> acc, run_max, run_sum, correction, scores, q_scaled;
  std::vector<const void*> queries;
  std::vector<int64_t> k_offsets;
  DecodeScratch(int64_t num_heads, int64_t head_dim)
      : acc(num_heads * head_dim),
        // Per head and a vector's padding (up to 16 lanes); the scores start zeroed, so that
        // the padding lanes the dots never write stay finite.
        run_max(num_heads + 16),
        run_sum(num_heads + 16),
        correction(num_heads + 16),
        scores((num_heads + 16) * kChunk),
        q_scaled(num_heads * head_dim),
        queries(num_heads + 4),
        k_offsets(num_heads + 4) {}
};

#if defined(LLM_SUITE_HAS_SIMD)
// q . k of one head against cache rows, unreduced (W partial sums). Generically q is float32,
// widened and scaled once per work item (``Query``, ``kScaledQuery``), and the rows are FMAed
// as stored (float32) or widened in registers (bfloat16: a 16-bit shift); where the CPU has
// AVX512-BF16, vdpbf16ps on the stored bf16 q and k pairs (exact products, float32 sums, no
// conversion pass), the scale applied to the scores.
template <class S, typename T, int HD>
struct HeadDot {
  using Query = float;
  static constexpr bool kScaledQuery = true;
  static constexpr int V = HD / S::W;
  typename S::F q[V];
  void load(const float* p) {
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
  using Query = c10::BFloat16;
  static constexpr bool kScaledQuery = false;
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

// acc[r] += sum_p w[p * ldw + r] v_p for NR query heads of one kv head over n value rows (the
// kv head's slice at offset off), in slices of the head that fit the registers with NR heads'
// sums (a compile-time NR: a runtime count kept the sums on the stack).
template <class S, typename T, int HD, int NR>
inline void value_pass(const T* const* v_rows, int64_t off, int64_t n, const float* w,
                       int64_t ldw, float* acc) {
  using F = typename S::F;
  constexpr int W = S::W, V = HD / W;
  constexpr int VS = V < S::kValueSlice ? V : S::kValueSlice;
  for (int j0 = 0; j0 < V; j0 += VS) {
    F a[NR][VS];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < VS; ++j) a[r][j] = S::load(acc + r * HD + W * (j0 + j));
    for (int64_t p = 0; p < n; ++p) {
      const T* vp = v_rows[p] + off + W * j0;
      F v[VS];
      for (int j = 0; j < VS; ++j) v[j] = S::load(vp + W * j);
      for (int r = 0; r < NR; ++r) {
        const F s = S::set1(w[p * ldw + r]);
        for (int j = 0; j < VS; ++j) a[r][j] = S::fmadd(s, v[j], a[r][j]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < VS; ++j) S::store(acc + r * HD + W * (j0 + j), a[r][j]);
  }
}

// Row pointers of positions [p0, p0 + n) of one cache through a block table (one division).
template <typename T>
inline void paged_rows(const T* cache, int64_t row_stride, const int32_t* table,
                       int64_t block_size, int64_t p0, int64_t n, const T** rows) {
  int64_t b = p0 / block_size, o = p0 - b * block_size;
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = cache + (static_cast<int64_t>(table[b]) * block_size + o) * row_stride;
    if (++o == block_size) o = 0, ++b;
  }
}

// Rows of K fetched ahead of their use (and each V row while its K row is scored): a row is
// every kv head of the item (1 KB for 8 heads of 64 bf16) and blocks are scattered, so the
// hardware prefetchers lose the stream at every block edge. 32 rows of 300 positions, 16
// layers of the 1B shape, 2 threads of the Zen 5 here: 18.7 ms without, 11.0-12.1 ms with at
// any distance from 2 to 24 rows and either hint (hot caches: 5.1 ms; memory-bound).
constexpr int64_t kRowsAhead = 6;
// Rows of K and V fetched into L2 further ahead (the first ones at once): in a server's step
// the weights' stream has flushed every cache, and at one sequence (a few items, each a few
// heads, 256 bytes of a row) the near prefetch alone kept too few lines in flight. 1B Q4_K_M,
// one row, whole decode step on the Zen 4 here, 2 threads: 21.89 -> 21.67 ms at 200
// positions, 23.91 -> 22.97 at 1,000, 30.01 -> 26.72 at 3,000.
constexpr int64_t kFarRows = 48;

// One sequence's decode attention for kv heads [g0, g1) in ONE pass over its cache rows, with
// an online softmax over chunks of kChunk positions. Position-major: each K row is read once
// for all of the item's query heads (their scores one row of a [kChunk][heads] block, four
// heads per horizontal reduction), and the softmax runs across heads, W heads a vector, with
// no horizontal reduction at all. Values: per kv head, R query heads at a time.
template <class S, typename T, int HD>
void decode_sequence(const DecodeItem<T>& it, DecodeScratch& scratch) {
  using F = typename S::F;
  constexpr int W = S::W, V = HD / W;
  constexpr int R = S::kValueRows;
  const int64_t rep = it.rep, h0 = it.g0 * rep, h1 = it.g1 * rep, nh = h1 - h0;
  const int64_t ldh = (nh + W - 1) / W * W;  // a score row: the item's heads, whole vectors
  // q widened and scaled once per item, or (vdpbf16ps) read as stored and the scores scaled.
  using Dot = HeadDot<S, T, HD>;
  using Query = typename Dot::Query;
  float* acc = scratch.acc.data() + h0 * HD;
  float* run_max = scratch.run_max.data();
  float* run_sum = scratch.run_sum.data();
  float* correction = scratch.correction.data();
  float* scores = scratch.scores.data();
  // Per item head (padded to whole fours with the last one): its query and its kv head's
  // offset in a K row, so that the dots divide nothing.
  const void** queries = scratch.queries.data();
  int64_t* k_offsets = scratch.k_offsets.data();
  for (int64_t h = 0; h < (nh + 3) / 4 * 4; ++h) {
    const int64_t hh = h0 + std::min(h, nh - 1);
    k_offsets[h] = (hh / rep) * it.k_head;
    if constexpr (!Dot::kScaledQuery) {
      queries[h] = it.q + hh * it.q_head_stride;
    } else {
      float* qs = scratch.q_scaled.data() + std::min(h, nh - 1) * HD;
      for (int j = 0; j < HD; ++j) qs[j] = to_f32(it.q[hh * it.q_head_stride + j]) * it.scale;
      queries[h] = qs;
    }
  }
  for (int64_t i = 0; i < ldh; ++i) run_max[i] = -INFINITY, run_sum[i] = 0.0f;
  std::fill(acc, acc + nh * HD, 0.0f);
  const char* k_base = reinterpret_cast<const char*>(it.k_cache + it.g0 * it.k_head);
  const char* v_base = reinterpret_cast<const char*>(it.v_cache + it.g0 * it.v_head);
  const int64_t k_bytes = (it.g1 - it.g0) * it.k_head * static_cast<int64_t>(sizeof(T));
  const int64_t v_bytes = (it.g1 - it.g0) * it.v_head * static_cast<int64_t>(sizeof(T));
  const T* k_rows[kChunk + kFarRows];
  const T* v_rows[kChunk + kFarRows];
  for (int64_t c0 = it.first; c0 < it.len; c0 += kChunk) {
    const int64_t n = std::min(kChunk, it.len - c0);
    const int64_t num_known = std::min(kChunk + kFarRows, it.len - c0);
    paged_rows(it.k_cache, it.k_row, it.table, it.block_size, c0, num_known, k_rows);
    paged_rows(it.v_cache, it.v_row, it.table, it.block_size, c0, num_known, v_rows);
    if (c0 == it.first)  // the first rows' K and V into L2 at once
      for (int64_t j = 0; j < std::min(kFarRows, num_known); ++j) {
        const char* kf = k_base + (k_rows[j] - it.k_cache) * sizeof(T);
        const char* vf = v_base + (v_rows[j] - it.v_cache) * sizeof(T);
        for (int64_t o = 0; o < k_bytes; o += 64) _mm_prefetch(kf + o, _MM_HINT_T1);
        for (int64_t o = 0; o < v_bytes; o += 64) _mm_prefetch(vf + o, _MM_HINT_T1);
      }
    for (int64_t i = 0; i < n; ++i) {
      if (i + kFarRows < num_known) {  // far ahead into L2
        const char* kf = k_base + (k_rows[i + kFarRows] - it.k_cache) * sizeof(T);
        const char* vf = v_base + (v_rows[i + kFarRows] - it.v_cache) * sizeof(T);
        for (int64_t o = 0; o < k_bytes; o += 64) _mm_prefetch(kf + o, _MM_HINT_T1);
        for (int64_t o = 0; o < v_bytes; o += 64) _mm_prefetch(vf + o, _MM_HINT_T1);
      }
      if (i + kRowsAhead < num_known) {  // K ahead into L1, this row's V into L2
        const char* k_next = k_base + (k_rows[i + kRowsAhead] - it.k_cache) * sizeof(T);
        for (int64_t o = 0; o < k_bytes; o += 64) _mm_prefetch(k_next + o, _MM_HINT_T0);
      }
      const char* v_this = v_base + (v_rows[i] - it.v_cache) * sizeof(T);
      for (int64_t o = 0; o < v_bytes; o += 64) _mm_prefetch(v_this + o, _MM_HINT_T1);
      float* row = scores + i * ldh;
      for (int64_t h = 0; h < nh; h += 4) {  // past the last head: padding lanes
        F part[4];
        for (int j = 0; j < 4; ++j) {
          Dot dot;
          dot.load(static_cast<const Query*>(queries[h + j]));
          part[j] = dot.partial(k_rows[i] + k_offsets[h + j]);
        }
        __m128 s = S::reduce4(part[0], part[1], part[2], part[3]);
        if constexpr (!Dot::kScaledQuery) s = _mm_mul_ps(s, _mm_set1_ps(it.scale));
        _mm_storeu_ps(row + h, s);
      }
    }
    // Soft-capping (Gemma 2), the chunk's scores in vectors (padding lanes hold finite values):
    // with libm's scalar tanh per score, decode attention at 1000 positions took 1.56x as long.
    if (it.softcap > 0.0f) {
      const F cap = S::set1(it.softcap), inv_cap = S::set1(1.0f / it.softcap);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < ldh; j += W) {
          float* p = scores + i * ldh + j;
          S::store(p, S::mul(cap, tanh_v<S>(S::mul(S::load(p), inv_cap))));
        }
    }
    // Online softmax across heads: exponentials against the new running max, what was summed
    // so far rescaled to it (the correction, ~0 on the first chunk).
    for (int64_t j = 0; j < ldh; j += W) {
      const F old_max = S::load(run_max + j);
      F m = old_max;
      for (int64_t i = 0; i < n; ++i) m = S::max(m, S::load(scores + i * ldh + j));
      const F c = exp_nonpositive_v<S>(S::sub(old_max, m));
      F sum = S::mul(S::load(run_sum + j), c);
      for (int64_t i = 0; i < n; ++i) {
        const F e = exp_nonpositive_v<S>(S::sub(S::load(scores + i * ldh + j), m));
        S::store(scores + i * ldh + j, e);
        sum = S::add(sum, e);
      }
      S::store(run_max + j, m);
      S::store(run_sum + j, sum);
      S::store(correction + j, c);
    }
    if (c0 > it.first)
      for (int64_t h = 0; h < nh; ++h)
        if (correction[h] != 1.0f) {
          const F c = S::set1(correction[h]);
          for (int j = 0; j < V; ++j) S::store(acc + h * HD + W * j, S::mul(c, S::load(acc + h * HD + W * j)));
        }
    for (int64_t g = it.g0; g < it.g1; ++g) {
      for (int64_t r0 = 0; r0 < rep; r0 += R) {
        const int64_t hb = g * rep + r0 - h0;  // the item's head
        const float* w = scores + hb;
        float* a = acc + hb * HD;
        const int64_t off = g * it.v_head;
        switch (std::min<int64_t>(R, rep - r0)) {  // <= R: the cases past R are never taken
          case 4: value_pass<S, T, HD, std::min(R, 4)>(v_rows, off, n, w, ldh, a); break;
          case 3: value_pass<S, T, HD, std::min(R, 3)>(v_rows, off, n, w, ldh, a); break;
          case 2: value_pass<S, T, HD, 2>(v_rows, off, n, w, ldh, a); break;
          default: value_pass<S, T, HD, 1>(v_rows, off, n, w, ldh, a); break;
        }
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
    const float inv = 1.0f / run_sum[h];
    T* dst = it.out + (h0 + h) * it.out_head_stride;
    for (int j = 0; j < HD; ++j) dst[j] = from_f32<T>(acc[h * HD + j] * inv);
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

  // Work items: a sequence's kv heads in groups as large as leave two items a thread (whole
  // sequences, each block's rows read as one contiguous stretch, when there are that many
  // sequences), else one kv head each. Longest first, handed out one at a time, so that one
  // long context does not land last on a thread. A larger group fills more of the softmax's
  // vector lanes (a lane a query head) and reads longer stretches of each K/V row: one row of
  // the 1B shape (8 kv heads, 4 query heads each), 2 threads, the Zen 4 here, 16 layers: 21.4
  // -> 18.2 us a layer at 200 positions, 144 -> 118 at 1,000, 767 -> 726 at 4,000.
  const int64_t num_threads = at::get_num_threads();
  int64_t heads_per_item = 1;
  for (int64_t d = num_kv_heads; d > 1; --d)
    if (num_kv_heads % d == 0 && num_seqs * (num_kv_heads / d) >= 2 * num_threads) {
      heads_per_item = d;
      break;
    }
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  const int64_t num_items = num_seqs * items_per_seq;
  std::vector<int64_t> order(num_items);
  for (int64_t i = 0; i < num_items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return lens[a / items_per_seq] > lens[b / items_per_seq];
  });
  std::atomic<int64_t> next{0};

  auto run_item = [&](int64_t item, DecodeScratch& scratch) {
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
    if constexpr (kIsSimdIo<T>) {
      const DecodeItem<T> it{qs,    q_s1,  kp, vp,                     // q, the caches
                             kc_s0, vc_s0, kc_s1, vc_s1,              // their strides
                             g0,    g1,    rep,   table, block_size,  // heads, blocks
                             first, len,   fscale, fsoftcap,          // positions, scores
                             os,    head_dim};
      switch (head_dim) {
        case 64: return decode_sequence<Simd, T, 64>(it, scratch);
        case 128: return decode_sequence<Simd, T, 128>(it, scratch);
        case 256: return decode_sequence<Simd, T, 256>(it, scratch);  // Gemma's head size
        default: break;
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
    DecodeScratch scratch(num_heads, head_dim);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1))
      run_item(order[i], scratch);
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
