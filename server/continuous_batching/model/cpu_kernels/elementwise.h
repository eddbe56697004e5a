// The decoder's element-wise kernels: RMSNorm (alone or after the residual add), SiLU-and-mul,
// RoPE with the step's K/V cache writes, and the refinement of 16-bit logits. Plain float32
// loops that g++ vectorises for the build's ISA (-mavx2 or -mavx512f...), one rounding each.
#pragma once

#include "simd.h"

namespace {

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
// act(gate) * up for the fused gate_up output [T, 2I] -> [T, I], where act(g) = g sigmoid(z(g)):
// SiLU (z = g), and GELU with the tanh approximation (Gemma's GeGLU; torch's formula,
// 0.5 g (1 + tanh(y)) with y = sqrt(2 / pi) (g + 0.044715 g^3), is g sigmoid(2 y)). Written
// with explicit vectors: left to g++, the AVX2 build's loop stayed scalar (SiLU 14x slower than
// AVX-512's at 32 rows) and GELU called libm's tanh per element.
struct SiluGate {
  static float z(float g) { return g; }
#if defined(LLM_SUITE_HAS_SIMD)
  static Simd::F z(Simd::F g) { return g; }
#endif
};

struct GeluTanhGate {
  static constexpr float kA = 2.0f * 0.7978845608028654f;  // 2 sqrt(2 / pi)
  static constexpr float kB = kA * 0.044715f;
  static float z(float g) { return g * (kA + kB * g * g); }
#if defined(LLM_SUITE_HAS_SIMD)
  static Simd::F z(Simd::F g) {
    return Simd::mul(g, Simd::fmadd(Simd::mul(g, g), Simd::set1(kB), Simd::set1(kA)));
  }
#endif
};

template <typename T, typename Gate>
void gated_and_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, gs = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gp + t * gs;
      const T* u = g + inter;
      T* dst = op + t * inter;
      int64_t i = 0;
#if defined(LLM_SUITE_HAS_SIMD)
      if constexpr (kIsSimdIo<T>) {
        for (; i + Simd::W <= inter; i += Simd::W) {
          const Simd::F gv = Simd::load(g + i);
          const Simd::F act = Simd::mul(gv, sigmoid_v<Simd>(Gate::z(gv)));
          store_lanes(dst + i, Simd::mul(act, Simd::load(u + i)));
        }
      }
#endif
      for (; i < inter; ++i) {
        const float gf = to_f32(g[i]);
        dst[i] = from_f32<T>(gf * sigmoid(Gate::z(gf)) * to_f32(u[i]));
      }
    }
  });
}

template <typename Gate>
at::Tensor gated_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I] rows");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "gated", [&] {
    gated_and_mul_impl<scalar_t, Gate>(gate_up, out);
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) { return gated_and_mul<SiluGate>(gate_up); }

at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) {
  return gated_and_mul<GeluTanhGate>(gate_up);
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
#if defined(LLM_SUITE_HAS_SIMD)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        constexpr int W = Simd::W;
        for (; i + W <= vocab; i += W) {
          const auto x = Simd::load(src + i);
          Simd::store(dst + i, x);
          // NaN never passes (ordered compare), as in the scalar tail.
          uint32_t over = Simd::greater_mask(x, Simd::set1(threshold));
          if (num_top < k) over = (1u << W) - 1u;
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

}  // namespace
