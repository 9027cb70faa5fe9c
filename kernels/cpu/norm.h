// Residual add + RMSNorm in one pass over each row.
#pragma once

#include <cmath>

#include <ATen/Parallel.h>

#include "common.h"

namespace asyncserve {

// h: [rows, hidden] (row stride h_stride), delta: same shape or null, out: [rows, hidden].
// With delta: h += delta, rounded to T as eager torch rounds it. Then
// out = T(T(h * rsqrt(mean(h^2) + eps)) * weight), the rounding steps of torch's rms_norm.
template <typename T>
void add_rms_norm(T* h, int64_t h_stride, const T* delta, int64_t delta_stride, const T* weight,
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
      float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < hidden; ++i) {
        float v = to_float(x[i]);
        sum_sq += v * v;
      }
      const float inv_rms = 1.0f / std::sqrt(sum_sq / float(hidden) + eps);
      T* y = out + r * out_stride;
      for (int64_t i = 0; i < hidden; ++i) {
        float normed = to_float(from_float<T>(to_float(x[i]) * inv_rms));
        y[i] = from_float<T>(normed * to_float(weight[i]));
      }
    }
  });
}

}  // namespace asyncserve
