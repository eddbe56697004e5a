// Scalar helpers shared by every kernel (see cpu_kernels.cpp for how the pieces fit): dtype
// conversions and the float32 loops that g++ -O3 vectorises for whichever ISA the build names.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;  // one AVX-512 register of floats; two AVX2 registers elsewhere

// A compile-time int passed as a value: how a runtime choice picks a template instance.
template <int V>
using Const = std::integral_constant<int, V>;

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

// sigmoid(z) from exp(-|z|) only: no overflow for either sign.
inline float sigmoid(float z) {
  const float e = exp_nonpositive(-std::fabs(z));
  return (z >= 0.0f ? 1.0f : e) / (1.0f + e);
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

}  // namespace
