// Some rows of a weight kept quantised, dequantised to float32: a packed embedding table's
// lookup (the step's tokens' rows). The torch path (PackedWeight.select_rows().dequantize())
// is the reference; it ran ~25 small ops a step, 0.4 ms of a 24 ms batch-1 decode step of the
// 1B Q4_K_M (Q6_K embedding, tiled), where this is one pass over the rows asked for.
// Plain layouts (qgemm.h) and the tiled ones (lane_tiles.h: 4-, 5- and 6-bit tiles); value =
// super_scale * group_scale * code - super_offset * group_offset, the reference's products in
// its order (no fused multiply-add), so every value is equal to it.
#pragma once

#include "qgemm.h"

namespace {

// Element i of a per-row scale or offset tensor, as float32 (qgemm.h's small_to_float).
inline float scale_value(const void* base, at::ScalarType type, int64_t i) {
  float value;
  small_to_float(base, type, i, &value, 1);
  return value;
}

// Where element (row, col) of a per-row [N, C] tensor is: tiles of 16 rows store it [C][16].
inline int64_t row_value_index(int64_t row, int64_t col, int64_t num_cols, bool is_tiled) {
  if (!is_tiled) return row * num_cols + col;
  return ((row / 16) * num_cols + col) * 16 + row % 16;
}

// Row `row`'s codes, each as an integer: the plain layouts (4-bit: byte j of a group of 32
// holds elements j and j + 16; 8-bit: int8) or the tiles (lane_tiles.h; 5- and 6-bit tiles
// hold code + code_offset).
void row_codes(const QuantWeight& w, int64_t row, bool is_tiled, int code_offset, int* out) {
  const int64_t k = w.k;
  if (!is_tiled) {
    const uint8_t* src = w.codes + row * w.row_bytes;
    if (w.bits == 8) {
      for (int64_t i = 0; i < k; ++i) out[i] = static_cast<int8_t>(src[i]);
      return;
    }
    for (int64_t g = 0; g < k / 32; ++g)
      for (int j = 0; j < 16; ++j) {
        out[g * 32 + j] = src[g * 16 + j] & 0x0F;
        out[g * 32 + 16 + j] = src[g * 16 + j] >> 4;
      }
    return;
  }
  const uint8_t* tile = w.codes + (row / 16) * 16 * w.row_bytes;
  const int64_t lane = (row % 16) * 4;  // this row's 4 bytes in each 64-byte vector
  if (w.bits == 4) {  // [K/8][16][4]: low nibble k = 8p + j, high 8p + 4 + j
    for (int64_t p = 0; p < k / 8; ++p)
      for (int j = 0; j < 4; ++j) {
        const uint8_t byte = tile[p * 64 + lane + j];
        out[8 * p + j] = byte & 0x0F;
        out[8 * p + 4 + j] = byte >> 4;
      }
    return;
  }
  // 6-bit: per 16 k, two vectors of nibbles (k-quads 0|1, 2|3), one of bits 4-5 (quad q at
  // bits 2q); 5-bit: per 32 k, four of nibbles (quads 2p|2p+1), one of bit 4 (quad q at bit q).
  const int unit = w.bits == 6 ? 16 : 32, num_vectors = w.bits == 6 ? 3 : 5;
  const int high_bits = w.bits - 4, high_mask = (1 << high_bits) - 1;
  for (int64_t u = 0; u < k / unit; ++u) {
    const uint8_t* vectors = tile + u * num_vectors * 64 + lane;
    const uint8_t* high = vectors + (num_vectors - 1) * 64;
    for (int q = 0; q < unit / 4; ++q)
      for (int j = 0; j < 4; ++j) {
        const uint8_t byte = vectors[(q / 2) * 64 + j];
        const int low = q % 2 == 0 ? byte & 0x0F : byte >> 4;
        const int up = (high[j] >> (high_bits * q)) & high_mask;
        out[u * unit + 4 * q + j] = (low | up << 4) - code_offset;
      }
  }
}

// rows [R] (int64) of the weight -> float32 [R, K].
at::Tensor dequantize_rows(const at::Tensor& codes, int64_t bits, int64_t group,
                           const at::Tensor& group_scale,
                           const c10::optional<at::Tensor>& group_offset,
                           const c10::optional<at::Tensor>& super_scale,
                           const c10::optional<at::Tensor>& super_offset, const at::Tensor& rows,
                           bool is_tiled, int64_t code_offset) {
  const QuantWeight w =
      quant_weight_of(codes, bits, group, group_scale, group_offset, super_scale, super_offset);
  TORCH_CHECK(is_tiled ? (bits == 4 || bits == 5 || bits == 6) && w.n % 16 == 0
                       : bits == 4 || bits == 8,
              "codes of 4 or 8 bits, or tiles of 4, 5 or 6 bits of whole 16-row tiles");
  TORCH_CHECK(w.k % 32 == 0, "K a multiple of 32");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows: int64 [R]");
  const at::Tensor index = rows.contiguous();
  const int64_t num_rows = index.size(0), k = w.k;
  const int64_t* picked = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r)
    TORCH_CHECK(picked[r] >= 0 && picked[r] < w.n, "row ", picked[r], " out of range");
  at::Tensor out = at::empty({num_rows, k}, codes.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const bool is_half = w.super_scale_half != nullptr;
  const void* super_s = is_half ? static_cast<const void*>(w.super_scale_half) : w.super_scale;
  const void* super_o = is_half ? static_cast<const void*>(w.super_offset_half) : w.super_offset;
  const at::ScalarType super_type = is_half ? at::kHalf : at::kFloat;
  at::parallel_for(0, num_rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<int> row_code(k);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t row = picked[r];
      row_codes(w, row, is_tiled, static_cast<int>(code_offset), row_code.data());
      for (int64_t g = 0; g < w.num_groups; ++g) {
        const int64_t gi = row_value_index(row, g, w.num_groups, is_tiled);
        const int64_t si = row_value_index(row, g / w.groups_per_super, w.num_super, is_tiled);
        float scale = scale_value(w.group_scale, w.scale_type, gi);
        if (super_s) scale = scale_value(super_s, super_type, si) * scale;
        float offset = 0.0f;
        if (w.group_offset) {
          offset = scale_value(w.group_offset, w.offset_type, gi);
          if (super_o) offset = scale_value(super_o, super_type, si) * offset;
        }
        float* values = dst + r * k + g * w.group;
        const int* group_codes = row_code.data() + g * w.group;
        for (int64_t i = 0; i < w.group; ++i) {
          const float product = scale * static_cast<float>(group_codes[i]);
          values[i] = w.group_offset ? product - offset : product;
        }
      }
    }
  });
  return out;
}

}  // namespace
