// RoPE on a step's q and k in place, then k and v written into the paged KV pool.
#pragma once

#include <vector>

#include <ATen/Parallel.h>

#include "common.h"

namespace asyncserve {

// qkv: [tokens, (nh + 2 nkv) * hd] (row stride qkv_stride), q heads then k heads then v heads.
// cos, sin: [max_pos, rot] tables (rotate-half convention: both halves hold the same angles) for each
// head's first rot dimensions (rot = hd but for partial RoPE, Phi-4-mini's); the others pass unrotated.
// kv_rows: the pool as rows of nkv * hd; token t's K goes to row write_rows[t] + k_offset, its V
// to write_rows[t] + v_offset.
template <typename T>
void rope_write_kv(T* qkv, int64_t qkv_stride, const int64_t* positions, const T* cos, const T* sin,
                   int64_t table_stride, T* kv_rows, const int64_t* write_rows, int64_t k_offset,
                   int64_t v_offset, int64_t tokens, int64_t nh, int64_t nkv, int64_t hd, int64_t rot) {
  const int64_t half = rot / 2, kv_size = nkv * hd;
  // a decode step's few tokens stay on the calling thread: a fork/join costs more than they do
  const int64_t grain = std::max<int64_t>(1, 65536 / ((nh + 3 * nkv) * hd));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> head_f32(rot);
    float* __restrict__ xf = head_f32.data();
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * qkv_stride;
      const T* c = cos + positions[t] * table_stride;
      const T* s = sin + positions[t] * table_stride;
      for (int64_t head = 0; head < nh + nkv; ++head) {
        T* x = row + head * hd;
        // through an fp32 copy: plain loops that gcc vectorises (in place over both halves it does not)
        for (int64_t i = 0; i < rot; ++i) xf[i] = to_float(x[i]);
        for (int64_t i = 0; i < half; ++i) x[i] = from_float<T>(xf[i] * to_float(c[i]) - xf[i + half] * to_float(s[i]));
        for (int64_t i = half; i < rot; ++i) x[i] = from_float<T>(xf[i] * to_float(c[i]) + xf[i - half] * to_float(s[i]));
      }
      const T* k = row + nh * hd;
      const T* v = k + kv_size;
      T* k_dst = kv_rows + (write_rows[t] + k_offset) * kv_size;
      T* v_dst = kv_rows + (write_rows[t] + v_offset) * kv_size;
      for (int64_t i = 0; i < kv_size; ++i) k_dst[i] = k[i];
      for (int64_t i = 0; i < kv_size; ++i) v_dst[i] = v[i];
    }
  });
}

}  // namespace asyncserve
