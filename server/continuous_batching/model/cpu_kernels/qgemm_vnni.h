// Batches and prefills of the super-block layouts (K-quants, GPTQ g128) with AVX512-VNNI: the
// integer products of qgemm_super.h, computed as a GEMM instead of row-by-row dot products.
// Weights tiled at load run qgemm_lanes.h instead (no per-call panels); this GEMM serves the
// plain layout: weights whose rows are not whole tiles of 16, and direct callers.
// vpdpbusd multiplies 64 byte pairs into 16 int32 lanes; on a Zen 5 core it issues twice per
// cycle (548 GMAC/s a core, against 253 for vdpbf16ps), where the dot-product kernels, which
// reload every row of x per weight row and sum horizontally, reach about 250 GMAC/s on 2 cores.
//
// The lanes are rows of x: x's codes are packed per call as [blocks of 16/P rows][K/4P]
// [16/P][4P], P consecutive lanes one row's 4P consecutive codes, and a weight column's 4P
// codes are broadcast to all of them, so each 64-byte load of x serves kVnniCols columns and
// each broadcast V blocks of rows. A row's P lanes are added up at the end: P = 2 fills the
// lanes from 8 rows (a decode batch of 8 to 15), P = 1 from 16 and more (a group's int32 sums
// then cover 16 rows each: half the scale multiplies per product). vpdpbusd takes unsigned weight
// bytes times signed x: 4-bit codes (0..15) are unpacked as they are; 8-bit codes are stored
// + 128, which adds 128 sum_g sc_g sum(xq_g), taken off in int32 per super-block, as the
// offsets' integer sums are (two groups a vpdpwssd, from x's group sums):
//   y = sum_b d_b dx_b (sum_g sc_g (q_g . xq_g)) - dmin_b dx_b (sum_g m_g sum(xq_g))
// int32 arithmetic wraps, so the sums are exact whenever the true super-block sum fits (the
// bounds of qgemm_super.h): the same value as quant_linear_super, up to float summation order.
#pragma once

#include "qgemm_super.h"

namespace {

#if defined(__AVX512VNNI__) && defined(LLM_SUITE_SUPER_512)
#define LLM_SUITE_HAS_QGEMM_VNNI 1

// Fewer rows stay on the dot-product kernels, which read each weight byte once and unpack it in
// registers. The GEMM multiplies each group's sums by its scale (vpmulld): groups of 32 pay it
// once per 8 vpdpbusd a lane, groups of 16 (Q6_K) once per 4, and win only from more rows.
// Zen 5, 2 threads, weights streamed from memory as in decode (GMAC/s, this against them):
// Q4_K 4 rows 119 vs 229-234, 8 rows 231-243 vs 219-233, 10 rows 215-224 vs 219-230; Q6_K 12
// rows 198-214 vs 215-235, 16 rows 267-291 vs 215-218, 24 rows 324-332 vs 228-242. A 1B Q4_K_M
// decode step of 8 rows: 40.0-41.6 ms from 8 rows against 43.1-44.1 from 12 (minimum of 30).
constexpr int64_t kVnniMinRows = 8, kVnniMinRowsG16 = 16;
// Weight columns per register tile: 4 columns x 2 blocks of rows x 3 (group, super-block and
// float sums) = 24 accumulators, with room for two x vectors and the broadcasts. Three blocks
// (prefills and batches of 33 rows or more) would need 36 of the 32 registers, so some go to
// the stack; still, each load then serves more products, and 1B prefills ran 5% faster.
constexpr int kVnniCols = 4;

// x for the kernel: codes, per block of 16/P rows and 4P consecutive k one 64-byte vector;
// per lane its row's super-block scales, and group sums of codes (unbiased) as int16 pairs in
// the row's first lane (zero in the others: each row's sums count once).
struct VnniRows {
  std::vector<int8_t> codes;  // [blocks][K/4P][16/P][4P]
  std::vector<float> scale;   // [blocks][K/L][16]
  std::vector<int32_t> sums;  // [blocks][K/G/2][16]: group 2j low half, 2j + 1 high half
  int64_t num_blocks;
};

template <int P>
VnniRows pack_vnni_rows(const SuperRows& q, int64_t m, int64_t k, int64_t span, int64_t group) {
  constexpr int RB = 16 / P;
  const int64_t num_blocks = (m + RB - 1) / RB, ns = k / span, num_pairs = k / group / 2;
  VnniRows p{std::vector<int8_t>(num_blocks * 16 * k / P, 0),
             std::vector<float>(num_blocks * ns * 16),
             std::vector<int32_t>(num_blocks * num_pairs * 16), num_blocks};
  at::parallel_for(0, m, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t blk = r / RB, lane = (r % RB) * P;
      const int8_t* src = q.codes.data() + r * k;
      int8_t* dst = p.codes.data() + blk * RB * k + lane * 4;
      for (int64_t j = 0; j < k / (4 * P); ++j) std::memcpy(dst + j * 64, src + 4 * P * j, 4 * P);
      for (int64_t b = 0; b < ns; ++b)
        for (int i = 0; i < P; ++i) p.scale[(blk * ns + b) * 16 + lane + i] = q.scale[r * ns + b];
      const int16_t* sums = q.sums.data() + r * num_pairs * 2;
      for (int64_t j = 0; j < num_pairs; ++j) {
        const uint32_t lo = static_cast<uint16_t>(sums[2 * j]);
        const uint32_t hi = static_cast<uint16_t>(sums[2 * j + 1]);
        p.sums[(blk * num_pairs + j) * 16 + lane] = static_cast<int32_t>(lo | (hi << 16));
      }
    }
  });
  return p;
}

// The 4P codes at p as one broadcast to every lane.
template <int P>
inline __m512i broadcast_codes(const uint8_t* p) {
  if constexpr (P == 1) {
    int32_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm512_set1_epi32(v);
  } else {
    static_assert(P == 2, "one or two k-quads a lane");
    int64_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm512_set1_epi64(v);
  }
}

// kVnniCols weight columns made ready for the tile. Codes as unsigned bytes (4-bit unpacked,
// 8-bit + 128), interleaved [K/4P][kVnniCols][4P] so that one pointer with constant offsets
// reaches every broadcast of a k-step. Group scales as int32, and as int16 pairs (two groups a
// 32-bit lane, as x's sums are) each group's multiplier of sum(xq_g): the offset m_g, or 128 sc_g
// for 8-bit codes.
struct VnniPanel {
  std::vector<uint8_t> codes;    // [K/4P][kVnniCols][4P]
  std::vector<int32_t> sc;       // [kVnniCols][K/G]
  std::vector<int16_t> mins;     // [kVnniCols][K/G]: m_g (offset layouts)
  std::vector<int16_t> bias;     // [kVnniCols][K/G]: 128 sc_g (8-bit codes)
  std::vector<int64_t> columns;  // the weight rows behind the tile's columns
};

// 32 consecutive codes of a weight row from code u * 32, as unsigned bytes.
template <int B>
inline __m256i code_unit(const uint8_t* codes, int64_t u) {
  if constexpr (B == 4) {  // byte j of a group of 32: elements j and j + 16
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + u * 16));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + u * 32));
    return _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80)));
  }
}

// Four columns' 32 codes (a unit each) stored interleaved, 4P bytes of each column in turn.
template <int P>
inline void interleave_unit(const __m256i v[4], uint8_t* dst) {
  __m256i t0, t1, t2, t3;
  if constexpr (P == 1) {  // a 4 x 8 transpose of dwords
    const __m256i a = _mm256_unpacklo_epi32(v[0], v[1]), b = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i c = _mm256_unpacklo_epi32(v[2], v[3]), d = _mm256_unpackhi_epi32(v[2], v[3]);
    t0 = _mm256_unpacklo_epi64(a, c), t1 = _mm256_unpackhi_epi64(a, c);  // k-quads 0 1 | 4 5
    t2 = _mm256_unpacklo_epi64(b, d), t3 = _mm256_unpackhi_epi64(b, d);  // k-quads 2 3 | 6 7
  } else {  // a 4 x 4 transpose of qwords
    t0 = _mm256_unpacklo_epi64(v[0], v[1]), t1 = _mm256_unpacklo_epi64(v[2], v[3]);  // 0 | 2
    t2 = _mm256_unpackhi_epi64(v[0], v[1]), t3 = _mm256_unpackhi_epi64(v[2], v[3]);  // 1 | 3
  }
  auto* out = reinterpret_cast<__m256i*>(dst);
  _mm256_storeu_si256(out + 0, _mm256_permute2x128_si256(t0, t1, 0x20));
  _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(t2, t3, 0x20));
  _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(t0, t1, 0x31));
  _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(t2, t3, 0x31));
}

template <int B, int P, bool SIGNED, bool OFFSET>
void fill_vnni_panel(const QuantWeight& w, int64_t col0, VnniPanel& p) {
  static_assert(kVnniCols == 4, "interleave_unit takes four columns");
  const int64_t k = w.k, ng = w.num_groups;
  const int64_t room = kVnniCols * ng + 16;
  p.codes.resize(kVnniCols * k), p.sc.resize(room), p.columns.resize(kVnniCols);
  p.mins.resize(OFFSET ? room : 0), p.bias.resize(B == 8 ? room : 0);
  for (int c = 0; c < kVnniCols; ++c)  // a short last tile repeats its last column
    p.columns[c] = std::min(col0 + c, w.n - 1);
  const uint8_t* rows[kVnniCols];
  for (int c = 0; c < kVnniCols; ++c) rows[c] = w.codes + p.columns[c] * w.row_bytes;
  uint8_t* dst = p.codes.data();
  for (int64_t u = 0; u < k / 32; ++u) {
    __m256i v[kVnniCols];
    for (int c = 0; c < kVnniCols; ++c) v[c] = code_unit<B>(rows[c], u);
    interleave_unit<P>(v, dst + u * 32 * kVnniCols);
  }
  for (int c = 0; c < kVnniCols; ++c) {
    const int64_t col = p.columns[c];
    const auto* scales = static_cast<const uint8_t*>(w.group_scale) + col * ng;
    const auto* mins = OFFSET ? static_cast<const uint8_t*>(w.group_offset) + col * ng : nullptr;
    // 16 groups a step; the arrays have 16 entries of room past the last column's groups.
    for (int64_t g = 0; g < ng; g += 16) {
      const bool is_whole = g + 16 <= ng;
      alignas(16) uint8_t tail[16] = {};
      if (!is_whole) std::memcpy(tail, scales + g, ng - g);
      const __m128i bytes = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(is_whole ? scales + g : tail));
      _mm512_storeu_si512(p.sc.data() + c * ng + g,
                          SIGNED ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
      if constexpr (B == 8) {
        const __m256i wide = SIGNED ? _mm256_cvtepi8_epi16(bytes) : _mm256_cvtepu8_epi16(bytes);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.bias.data() + c * ng + g),
                            _mm256_slli_epi16(wide, 7));
      }
      if constexpr (OFFSET) {
        if (!is_whole) std::memcpy(tail, mins + g, ng - g);
        const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i*>(is_whole ? mins + g : tail));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.mins.data() + c * ng + g),
                            _mm256_cvtepu8_epi16(m));
      }
    }
  }
}

// sum_j pairs[j] . xsum[j] over one super-block's S / 2 group pairs, for a block of 16 rows.
template <int S>
inline __m512i pair_sums(const int16_t* pairs, const int32_t* xsum) {
  __m512i acc = _mm512_setzero_si512();
  for (int j = 0; j < S / 2; ++j) {
    int32_t pair;
    std::memcpy(&pair, pairs + 2 * j, sizeof(pair));
    acc = _mm512_dpwssd_epi32(acc, _mm512_set1_epi32(pair), _mm512_loadu_si512(xsum + j * 16));
  }
  return acc;
}

// Where the next tile's weight bytes are fetched from, a few lines per group of this one: a
// decode batch reads the weight from memory once, and fetched all at once at a tile's start
// the lines stalled the next fill (a fifth of a 32-row decode step under perf).
struct VnniPrefetch {
  const char* next = nullptr;  // nullptr: nothing to fetch
  int64_t lines_per_group = 0;
  void at_group(int64_t gi) const {
    for (int64_t j = 0; next && j < lines_per_group; ++j)
      __builtin_prefetch(next + (gi * lines_per_group + j) * 64, 0, 2);
  }
};

// total[c][v] lane l = weight column c . lane l of x's block blk0 + v, for V blocks.
template <int B, int G, int S, bool OFFSET, int V, int P>
void vnni_tile(const QuantWeight& w, const VnniPanel& p, const VnniRows& x, int64_t blk0,
               const VnniPrefetch& pf, __m512 total[kVnniCols][3]) {
  constexpr int C = kVnniCols, L = G * S, Q = G / (4 * P);
  static_assert(G % (4 * P) == 0, "a lane's codes lie in one group");
  const int64_t k = w.k, kq = k / (4 * P), ns = k / L, ng = k / G, np = ng / 2;
  const __m512i* xv0 = reinterpret_cast<const __m512i*>(x.codes.data()) + blk0 * kq;
  const float* xs = x.scale.data() + blk0 * ns * 16;
  const int32_t* xsum = x.sums.data() + blk0 * np * 16;
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < V; ++v) total[c][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < ns; ++b) {
    __m512i block[C][V];
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < V; ++v) block[c][v] = _mm512_setzero_si512();
    for (int g = 0; g < S; ++g) {
      const int64_t gi = b * S + g;
      pf.at_group(gi);
      // One base and one stride for x's blocks: with a pointer per block and k-step the
      // compiler kept them on the stack and reloaded one per step.
      const char* xg = reinterpret_cast<const char*>(xv0 + gi * Q);
      const int64_t x_stride = kq * 64;
      const uint8_t* wg = p.codes.data() + gi * G * C;
      __m512i acc[C][V];
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < V; ++v) acc[c][v] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int q = 0; q < Q; ++q) {
        __m512i xv[V];
        for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_si512(xg + v * x_stride + q * 64);
        for (int c = 0; c < C; ++c) {
          const __m512i wv = broadcast_codes<P>(wg + (q * C + c) * 4 * P);
          for (int v = 0; v < V; ++v) acc[c][v] = _mm512_dpbusd_epi32(acc[c][v], wv, xv[v]);
        }
      }
      for (int c = 0; c < C; ++c) {
        const __m512i sc = _mm512_set1_epi32(p.sc[c * ng + gi]);
        for (int v = 0; v < V; ++v)
          block[c][v] = _mm512_add_epi32(block[c][v], _mm512_mullo_epi32(acc[c][v], sc));
      }
    }
    for (int c = 0; c < C; ++c) {
      const int64_t col = p.columns[c];
      const __m512 d = _mm512_set1_ps(w.super_scale[col * ns + b]);
      const __m512 dmin = _mm512_set1_ps(OFFSET ? w.super_offset[col * ns + b] : 0.0f);
      for (int v = 0; v < V; ++v) {
        const int32_t* sums_b = xsum + (v * np + b * S / 2) * 16;
        __m512i exact = block[c][v];
        if constexpr (B == 8)  // the codes' + 128
          exact = _mm512_sub_epi32(exact, pair_sums<S>(p.bias.data() + c * ng + b * S, sums_b));
        const __m512 dx = _mm512_loadu_ps(xs + (v * ns + b) * 16);
        total[c][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(dx, d), total[c][v]);
        if constexpr (OFFSET) {
          const __m512i offsets = pair_sums<S>(p.mins.data() + c * ng + b * S, sums_b);
          total[c][v] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(offsets), _mm512_mul_ps(dx, dmin),
                                         total[c][v]);
        }
      }
    }
  }
}

inline bool takes_vnni(const at::Tensor& x, const QuantWeight& w) {
  return x.size(0) >= (w.group == 16 ? kVnniMinRowsG16 : kVnniMinRows) && super_layout(w);
}

// Rows [row0, row0 + num_rows) (at most 16, lane i row row0 + i) of the tile's columns from
// col0 into the output. Four whole columns are transposed so that each row's four values go out
// as one bias add and one store (the outputs one at a time cost a tenth of a 32-row GEMM).
inline void put_rows(const __m512 sums[kVnniCols], int64_t row0, int64_t num_rows, int64_t col0,
                     int64_t cols, const QuantOut& sink) {
  alignas(64) float out[4][16];
  if (cols < 4) {
    for (int c = 0; c < cols; ++c) _mm512_store_ps(out[c], sums[c]);
    for (int64_t i = 0; i < num_rows; ++i)
      for (int c = 0; c < cols; ++c) sink.put(row0 + i, col0 + c, out[c][i]);
    return;
  }
  static_assert(kVnniCols == 4, "a row's columns are one 128-bit lane");
  const auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  const auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  const __m512 ab = _mm512_unpacklo_ps(sums[0], sums[1]), ab2 = _mm512_unpackhi_ps(sums[0], sums[1]);
  const __m512 cd = _mm512_unpacklo_ps(sums[2], sums[3]), cd2 = _mm512_unpackhi_ps(sums[2], sums[3]);
  __m512 rows[4] = {lo(ab, cd), hi(ab, cd), lo(ab2, cd2), hi(ab2, cd2)};  // lane i: row 4 i + j
  const __m512 bias = sink.bias ? _mm512_broadcast_f32x4(_mm_loadu_ps(sink.bias + col0))
                                : _mm512_setzero_ps();
  for (int j = 0; j < 4; ++j) _mm512_store_ps(out[j], _mm512_add_ps(rows[j], bias));
  for (int64_t i = 0; i < num_rows; ++i) {
    const float* y = out[i % 4] + (i / 4) * 4;
    if (sink.bf16) {
      at::BFloat16* dst = sink.bf16 + (row0 + i) * sink.n + col0;
      for (int c = 0; c < 4; ++c) dst[c] = c10::BFloat16(y[c]);  // nearest even
    } else {
      std::memcpy(sink.f32 + (row0 + i) * sink.n + col0, y, 4 * sizeof(float));
    }
  }
}

// Two blocks of 8 rows with two lanes a row (P = 2) as one vector of 16 rows.
inline __m512 merge_lane_pairs(__m512 first, __m512 second) {
  const __m512 a = _mm512_add_ps(first, _mm512_permute_ps(first, 0xB1));  // lane 2i: row i
  const __m512 b = _mm512_add_ps(second, _mm512_permute_ps(second, 0xB1));
  const __m512 lo = _mm512_maskz_compress_ps(0x5555, a), hi = _mm512_maskz_compress_ps(0x5555, b);
  return _mm512_insertf32x8(lo, _mm512_castps512_ps256(hi), 1);
}

// Every block of x's rows against weight columns [col0, col0 + cols), written to the sink.
template <int B, int G, int S, bool OFFSET, int P>
void vnni_columns(const QuantWeight& w, const VnniPanel& panel, const VnniRows& xp, int64_t m,
                  int64_t col0, int64_t cols, const VnniPrefetch& pf, const QuantOut& sink) {
  constexpr int RB = 16 / P;
  for (int64_t blk = 0; blk < xp.num_blocks;) {
    // Three blocks a tile where they can be (12 accumulators: each x load and broadcast serves
    // more products), two at a time otherwise; 8-row blocks (P = 2) go two at a time.
    const int64_t left = xp.num_blocks - blk;
    const int num_v = P == 1 && left >= 3 && left != 4 ? 3 : (left >= 2 ? 2 : 1);
    __m512 total[kVnniCols][3];
    // The next tile's lines are fetched during the first pass over this panel only.
    const VnniPrefetch none{};
    const VnniPrefetch& fetch = blk == 0 ? pf : none;
    if (num_v == 3)
      vnni_tile<B, G, S, OFFSET, 3, P>(w, panel, xp, blk, fetch, total);
    else if (num_v == 2)
      vnni_tile<B, G, S, OFFSET, 2, P>(w, panel, xp, blk, fetch, total);
    else
      vnni_tile<B, G, S, OFFSET, 1, P>(w, panel, xp, blk, fetch, total);
    const int64_t row0 = blk * RB, num_rows = std::min<int64_t>(num_v * RB, m - row0);
    blk += num_v;
    __m512 sums[kVnniCols];
    if constexpr (P == 2) {
      for (int c = 0; c < kVnniCols; ++c)
        sums[c] = merge_lane_pairs(total[c][0], num_v == 2 ? total[c][1] : _mm512_setzero_ps());
      put_rows(sums, row0, num_rows, col0, cols, sink);
      continue;
    }
    for (int v = 0; v < num_v; ++v) {
      for (int c = 0; c < kVnniCols; ++c) sums[c] = total[c][v];
      put_rows(sums, row0 + v * 16, std::min<int64_t>(16, num_rows - v * 16), col0, cols, sink);
    }
  }
}

// y = x . W^T (+ bias) with x quantised per super-block; the caller checked takes_vnni(x, w).
at::Tensor quant_linear_vnni(const at::Tensor& x, const QuantWeight& w,
                             const c10::optional<at::Tensor>& bias) {
  const QuantCall call = begin_quant_call(x, w, bias);
  if (call.is_empty()) return call.out;
  const int64_t m = call.m, n = call.n, k = w.k;
  const QuantOut& sink = call.sink;
  with_super_layout(w, [&](auto b, auto g, auto s, auto is_signed, auto is_offset) {
    constexpr int B = decltype(b)::value, G = decltype(g)::value, S = decltype(s)::value;
    constexpr bool SIGNED = decltype(is_signed)::value, OFFSET = decltype(is_offset)::value;
    const SuperRows& xq = quantize_super(call.x, G * S, G, false);
    // Blocks of 16 rows from 16 rows up, of 8 rows (two k-quads a lane each) below.
    const auto run = [&](auto lanes_per_row) {
      constexpr int P = decltype(lanes_per_row)::value;
      const VnniRows xp = pack_vnni_rows<P>(xq, m, k, G * S, G);
      // Lines of the next tile's codes to fetch per group of this one.
      const int64_t lines = (kVnniCols * w.row_bytes + 63) / 64;
      const int64_t lines_per_group = (lines + w.num_groups - 1) / w.num_groups;
      at::parallel_for(0, (n + kVnniCols - 1) / kVnniCols, 1, [&](int64_t t0, int64_t t1) {
        VnniPanel panel;
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t col0 = t * kVnniCols, cols = std::min<int64_t>(kVnniCols, n - col0);
          VnniPrefetch pf;
          if (t + 1 < t1) {
            const int64_t next = col0 + kVnniCols;
            for (int64_t col = next; col < std::min(n, next + kVnniCols); ++col) prefetch_scales(w, col);
            pf = VnniPrefetch{reinterpret_cast<const char*>(w.codes + next * w.row_bytes),
                              lines_per_group};
          }
          fill_vnni_panel<B, P, SIGNED, OFFSET>(w, col0, panel);
          vnni_columns<B, G, S, OFFSET, P>(w, panel, xp, m, col0, cols, pf, sink);
        }
      });
    };
    if (m >= 16)
      run(Const<1>{});
    else
      run(Const<2>{});
  });
  return call.out;
}
#endif

}  // namespace
