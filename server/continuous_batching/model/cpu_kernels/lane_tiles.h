// The tiled layout of the super-block layouts (K-quants, GPTQ g128), made once at load: tiles
// of 16 weight rows stored interleaved, so that one 64-byte load holds the 16 rows' next codes
// (the weight's rows are then the vector lanes: qgemm_lanes.h on AVX512-VNNI, 16 lanes a
// register; qgemm_lanes_avx2.h on AVX2, each 64-byte vector as two halves of 8 lanes).
// Per tile of 16 weight rows (its bytes and its scales stay inside the tile's own span of each
// tensor):
//   codes, 4-bit (Q4_K, GPTQ): [K/8][16 rows][4] bytes, byte j of row c: code k = 8p + j in
//                 the low nibble, 8p + 4 + j in the high one (the tensor keeps its shape);
//   codes, 6-bit (Q6_K as q + 32): per 16 k, 192 bytes: two 64-byte vectors of low
//                 nibbles as above (k-quads 0 and 1, then 2 and 3), then one of high bits, byte
//                 (4c + j) holding k-quad q's bits 4-5 at bits 2q, 2q + 1 (rows of K * 3 / 4
//                 bytes where the plain layout stored a byte per code);
//   codes, 5-bit (Q5_K: codes 0..31, groups of 32): per 32 k, 320 bytes: four vectors of low
//                 nibbles as the 4-bit tiles (k-quads 2p and 2p + 1 in vector p), then one of
//                 bit 4, byte (4c + j) holding k-quad q's at bit q (rows of K * 5 / 8 bytes);
//   group scales and offsets [K/G][16], super-block scales and offsets [K/L][16] (float32,
//   or fp16 where exact: a K-quant's d and dmin are fp16 in the file).
#pragma once

#include "qgemm_super.h"

namespace {

// The builds with a kernel for it: AVX512-VNNI (qgemm_lanes.h) and AVX2 (qgemm_lanes_avx2.h);
// AVX-512 without VNNI keeps the plain layout's 512-bit dot products (qgemm_super.h).
#if defined(LLM_SUITE_HAS_QGEMM_SUPER) && (defined(__AVX512VNNI__) || !defined(LLM_SUITE_SUPER_512))
#define LLM_SUITE_HAS_QGEMM_LANES 1
constexpr int64_t kLaneRows = 16;  // weight rows per tile: one 32-bit lane of AVX-512 each
// How far ahead of each 64-byte load its line is fetched. A tile's codes are one sequential
// stream, yet without it a batch of 8 rows stalled on memory: Q4_K 8192 x 2048 streamed, 2
// threads, GMAC/s at 8 / 32 rows: none 301 / 492, 1 KB 373 / 575, 4 KB 513 / 648, 8 KB
// 570 / 673, 16 KB 520-556 / 659 (one row: 70-110 at every distance, the plain layout's dot
// kernels 75-113 in the same runs).
constexpr int64_t kLanePrefetchBytes = 4096;
// Codes of the tiles one pass of rows covers, at most: each block of rows of x then meets a
// run of tiles that stays in L2 (a prefill's x, megabytes, is read once per run instead of once
// per tile). 1B Q4_K_M, 1024 rows, 2 threads: 3-5% over one tile a run; 64 KB and 1 MB runs
// were no faster than one tile.
constexpr int64_t kLaneChunkBytes = 256 * 1024;

// The tiled layouts: with_super_layout's, 8-bit codes tiled as 6 bits (B = 6) or, in groups
// of 32, as 5 (B = 5: a unit of 32 k).
template <typename Fn>
inline bool with_lane_layout(const QuantWeight& w, Fn&& fn) {
  if (w.bits != 4 && w.bits != 5 && w.bits != 6) return false;
  QuantWeight plain = w;
  plain.bits = w.bits == 4 ? 4 : 8;
  bool is_called = false;
  with_super_layout(plain, [&](auto b, auto g, auto s, auto is_signed, auto is_offset) {
    if constexpr (decltype(b)::value != 8) {
      fn(b, g, s, is_signed, is_offset);
      is_called = true;
    } else if (w.bits == 6) {
      fn(Const<6>{}, g, s, is_signed, is_offset);
      is_called = true;
    } else if constexpr (decltype(g)::value % 32 == 0) {
      fn(Const<5>{}, g, s, is_signed, is_offset);
      is_called = true;
    }
  });
  return is_called;
}

// The codes [N, K * bits / 8] of the packed layout (qgemm.h: 4-bit, byte j of a group of 32
// holds elements j and j + 16; 8-bit, int8) in the tiled layout above, uint8; 8-bit codes
// become tiles of code + code_offset of tile_bits bits (6: in 0..63, 5: in 0..31). N a multiple
// of 16.
at::Tensor lane_tile_codes(const at::Tensor& codes, int64_t bits, int64_t code_offset,
                           int64_t tile_bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "codes of 4 or 8 bits");
  TORCH_CHECK(bits == 4 || tile_bits == 5 || tile_bits == 6, "8-bit codes tile as 5 or 6 bits");
  const bool is_bytes = codes.scalar_type() == at::kByte || codes.scalar_type() == at::kChar;
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && is_bytes && codes.size(0) % kLaneRows == 0,
              "codes (u)int8 [N, K*bits/8], contiguous, N a multiple of 16");
  const int64_t n = codes.size(0), row_bytes = codes.size(1), k = row_bytes * 8 / bits;
  TORCH_CHECK(k % 32 == 0, "K a multiple of 32");
  const int64_t out_row_bytes = bits == 4 ? row_bytes : k * tile_bits / 8;
  const int max_code = bits == 4 ? 15 : (1 << tile_bits) - 1;
  at::Tensor out = at::empty({n, out_row_bytes}, codes.options().dtype(at::kByte));
  const auto* src = static_cast<const uint8_t*>(codes.data_ptr());
  uint8_t* dst = out.data_ptr<uint8_t>();
  std::atomic<bool> is_in_range{true};
  at::parallel_for(0, n / kLaneRows, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* rows = src + t * kLaneRows * row_bytes;
      uint8_t* tile = dst + t * kLaneRows * out_row_bytes;
      for (int64_t c = 0; c < kLaneRows; ++c) {
        const uint8_t* row = rows + c * row_bytes;
        const auto word_at = [&](int64_t offset) {
          uint32_t word;
          std::memcpy(&word, row + offset, sizeof(word));
          return word;
        };
        const auto put = [&](int64_t offset, uint32_t word) {  // row c's word at a vector
          std::memcpy(tile + offset + c * 4, &word, sizeof(word));
        };
        constexpr uint32_t kLow = 0x0F0F0F0Fu, kHigh = 0xF0F0F0F0u;
        const auto code_at = [&](int64_t i) {
          const int v = static_cast<int8_t>(row[i]) + code_offset;
          if (v < 0 || v > max_code) is_in_range = false;
          return v;
        };
        if (bits == 8 && tile_bits == 5) {  // per 32 k: four vectors of nibbles, one of bit 4
          for (int64_t blk = 0; blk < k / 32; ++blk) {
            uint32_t high = 0;
            for (int p = 0; p < 4; ++p) {
              uint32_t nibbles = 0;
              for (int j = 0; j < 4; ++j) {
                const int low = code_at(blk * 32 + 8 * p + j), up = code_at(blk * 32 + 8 * p + 4 + j);
                nibbles |= static_cast<uint32_t>((low & 0x0F) | (up & 0x0F) << 4) << (8 * j);
                high |= static_cast<uint32_t>(((low >> 4) & 1) << (2 * p) | ((up >> 4) & 1) << (2 * p + 1))
                        << (8 * j);
              }
              put(blk * 320 + p * 64, nibbles);
            }
            put(blk * 320 + 256, high);
          }
          continue;
        }
        if (bits == 8) {  // per 16 k: two vectors of nibbles, one of high bits
          for (int64_t blk = 0; blk < k / 16; ++blk) {
            uint32_t nibbles[2] = {0, 0}, high = 0;
            for (int q = 0; q < 4; ++q)
              for (int j = 0; j < 4; ++j) {
                const int v = code_at(blk * 16 + 4 * q + j);
                nibbles[q / 2] |= static_cast<uint32_t>(v & 0x0F) << (8 * j + 4 * (q % 2));
                high |= static_cast<uint32_t>((v >> 4) & 3) << (8 * j + 2 * q);
              }
            put(blk * 192, nibbles[0]);
            put(blk * 192 + 64, nibbles[1]);
            put(blk * 192 + 128, high);
          }
          continue;
        }
        // A group's 16 bytes: elements 0-15 in the low nibbles, 16-31 in the high ones; its
        // octets 0-3 are elements 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles).
        for (int64_t g = 0; g < k / 32; ++g) {
          const uint32_t w0 = word_at(g * 16), w1 = word_at(g * 16 + 4);
          const uint32_t w2 = word_at(g * 16 + 8), w3 = word_at(g * 16 + 12);
          put((4 * g + 0) * 64, (w0 & kLow) | ((w1 << 4) & kHigh));
          put((4 * g + 1) * 64, (w2 & kLow) | ((w3 << 4) & kHigh));
          put((4 * g + 2) * 64, ((w0 >> 4) & kLow) | (w1 & kHigh));
          put((4 * g + 3) * 64, ((w2 >> 4) & kLow) | (w3 & kHigh));
        }
      }
    }
  });
  TORCH_CHECK(is_in_range.load(), "8-bit codes plus code_offset must lie in 0..",
              max_code, " for ", tile_bits, "-bit tiles");
  return out;
}
#endif

}  // namespace
