// RMSNorm: residual add + norm in one pass over each row, and the per-head norm of q and k.
#pragma once

#include <cmath>
#include <type_traits>

#include <ATen/Parallel.h>

#include "common.h"

namespace asyncserve {

// One row: y = rms_norm(x) * weight (y may be x). With a weight of x's type T, the rounding steps
// of torch's rms_norm: y = T(T(x * rsqrt(mean(x^2) + eps)) * weight). With a float32 weight over
// bf16 x (Gemma's (1 + w), as transformers applies it): the product in float32, rounded once.
template <typename T, typename W>
inline void rms_norm_row(const T* x, const W* weight, T* y, int64_t hidden, float eps) {
  float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < hidden; ++i) {
    float v = to_float(x[i]);
    sum_sq += v * v;
  }
  const float inv_rms = 1.0f / std::sqrt(sum_sq / float(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) {
    float normed = to_float(x[i]) * inv_rms;
    if constexpr (std::is_same_v<T, W>) normed = to_float(from_float<T>(normed));
    y[i] = from_float<T>(normed * to_float(weight[i]));
  }
}

// h: [rows, hidden] (row stride h_stride), delta: same shape or null, out: [rows, hidden].
// With delta: h += delta, rounded to T as eager torch rounds it. Then out = rms_norm(h) * weight
// (rms_norm_row).
template <typename T, typename W>
void add_rms_norm(T* h, int64_t h_stride, const T* delta, int64_t delta_stride, const W* weight,
                  T* out, int64_t out_stride, int64_t rows, int64_t hidden, float eps) {
  // rows are short: a thread takes at least ~16k elements so small steps stay on the caller's thread
  const int64_t grain = std::max<int64_t>(1, 16384 / hidden);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = h + r * h_stride;
      if (delta != nullptr) {
        const T* d = delta + r * delta_stride;
        for (int64_t i = 0; i < hidden; ++i) x[i] = from_float<T>(to_float(x[i]) + to_float(d[i]));
      }
      rms_norm_row(x, weight, out + r * out_stride, hidden, eps);
    }
  });
}

// qkv: [tokens, (nh + 2 nkv) * hd] (row stride qkv_stride): q normed in place in nq parts of
// q_width with q_weight [q_width], k in nk parts of k_width with k_weight; v untouched. Per head
// (Qwen3's and Gemma 3's q/k norms: nq = nh, nk = nkv, widths hd) or whole (OLMo 2's: one part
// each), before RoPE.
template <typename T, typename W>
void head_rms_norm(T* qkv, int64_t qkv_stride, const W* q_weight, const W* k_weight, int64_t tokens, int64_t nq,
                   int64_t q_width, int64_t nk, int64_t k_width, float eps) {
  const int64_t q_size = nq * q_width;
  const int64_t grain = std::max<int64_t>(1, 16384 / (q_size + nk * k_width));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * qkv_stride;
      for (int64_t part = 0; part < nq; ++part)
        rms_norm_row(row + part * q_width, q_weight, row + part * q_width, q_width, eps);
      for (int64_t part = 0; part < nk; ++part)
        rms_norm_row(row + q_size + part * k_width, k_weight, row + q_size + part * k_width, k_width, eps);
    }
  });
}

}  // namespace asyncserve
