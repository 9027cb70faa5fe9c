// Paged decode attention: one query token per sequence against its cached K/V pages, read in place
// through the block table (no gather copy). Work items are (sequence, KV head, context part): the
// group of query heads that shares a KV head is computed together, so each K/V row is read once
// for the group. Online softmax over tiles of rows inside a page; fp32 accumulation. Rows past a
// sequence's context length are never read, so stale or uninitialised pool slots cannot leak in.
// When the step has too few (sequence, KV head) pairs to keep the threads busy, contexts are split
// into parts (flash-decoding) whose partial results are merged by their softmax statistics.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "common.h"

namespace asyncserve {

constexpr int64_t kAttentionTile = 32;        // rows scored before their values are accumulated
constexpr int64_t kMinContextPart = 128;      // shortest context part worth its own work item

struct DecodeAttentionShape {
  int64_t n, nh, nkv, hd, block;
};

// One (sequence, KV head, part): the group's softmax state over rows [row_begin, row_end).
// q: the group's first query row (query head rows q_head_stride apart); table: this sequence's
// block table. On return acc holds the unnormalised sum of p * v, row_max/row_sum the statistics.
// HD > 0 is head_dim known at compile time (the common sizes: unrolled loops, acc in registers);
// HD == 0 reads it from the shape. Scratch: q_f32 [group * hd], scores [group * tile],
// tile_f32 [tile * hd].
template <typename T, int HD>
void attend_part(const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache, int64_t kv_head,
                 int64_t page_stride, int64_t slot_stride, const int64_t* table, int64_t row_begin,
                 int64_t row_end, const DecodeAttentionShape& s, float scale, float* __restrict__ acc,
                 float* row_max, float* row_sum, float* __restrict__ q_f32, float* __restrict__ scores,
                 float* __restrict__ tile_f32) {
  const int64_t group = s.nh / s.nkv, hd = HD > 0 ? HD : s.hd;
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < hd; ++d) q_f32[g * hd + d] = to_float(q[g * q_head_stride + d]) * scale;
    row_max[g] = -std::numeric_limits<float>::infinity();
    row_sum[g] = 0.0f;
  }
  std::fill(acc, acc + group * hd, 0.0f);
  int64_t t = row_begin;
  while (t < row_end) {
    const int64_t slot = t % s.block;
    const int64_t rows = std::min({s.block - slot, row_end - t, kAttentionTile});
    const int64_t offset = table[t / s.block] * page_stride + slot * slot_stride + kv_head * hd;
    const T* k = k_cache + offset;
    const T* v = v_cache + offset;
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t d = 0; d < hd; ++d) tile_f32[j * hd + d] = to_float(k[j * slot_stride + d]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q_f32 + g * hd;
      for (int64_t j = 0; j < rows; ++j) {
        const float* kj = tile_f32 + j * hd;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < hd; ++d) dot += qg[d] * kj[d];
        scores[g * kAttentionTile + j] = dot;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores + g * kAttentionTile;
      float tile_max = sg[0];
      for (int64_t j = 1; j < rows; ++j) tile_max = std::max(tile_max, sg[j]);
      const float new_max = std::max(row_max[g], tile_max);
      // exp(-inf) on the first tile: clamped to ~1e-38, times a zero sum and zero acc
      const float correction = exp_nonpositive(row_max[g] - new_max);
      float tile_sum = 0.0f;
#pragma omp simd reduction(+ : tile_sum)
      for (int64_t j = 0; j < rows; ++j) {
        float p = exp_nonpositive(sg[j] - new_max);
        sg[j] = p;
        tile_sum += p;
      }
      row_sum[g] = row_sum[g] * correction + tile_sum;
      row_max[g] = new_max;
      if (correction != 1.0f) {
        float* ag = acc + g * hd;
        for (int64_t d = 0; d < hd; ++d) ag[d] *= correction;
      }
    }
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t d = 0; d < hd; ++d) tile_f32[j * hd + d] = to_float(v[j * slot_stride + d]);
    for (int64_t g = 0; g < group; ++g) {
      const float* pg = scores + g * kAttentionTile;
      float* __restrict__ ag = acc + g * hd;
      for (int64_t j = 0; j < rows; ++j) {
        const float p = pg[j];
        const float* vj = tile_f32 + j * hd;
        for (int64_t d = 0; d < hd; ++d) ag[d] += p * vj[d];
      }
    }
    t += rows;
  }
}

// out, q: [n, nh, hd] with row strides (*_s0, *_s1; hd contiguous). k_cache, v_cache: one layer's
// K and V; row `slot` of page p starts at p * page_stride + slot * slot_stride and holds nkv * hd
// values. tables: [n, table_stride] page ids; context_lens: [n], each >= 1.
template <typename T>
void paged_decode_attention(T* out, int64_t out_s0, int64_t out_s1, const T* q, int64_t q_s0, int64_t q_s1,
                            const T* k_cache, const T* v_cache, int64_t page_stride, int64_t slot_stride,
                            const int64_t* tables, int64_t table_stride, const int64_t* context_lens,
                            const DecodeAttentionShape& s, float scale) {
  const int64_t group = s.nh / s.nkv, hd = s.hd;
  int64_t max_ctx = 1;
  for (int64_t i = 0; i < s.n; ++i) max_ctx = std::max(max_ctx, context_lens[i]);
  const int64_t pairs = s.n * s.nkv;
  const int64_t busy = 4 * int64_t(at::get_num_threads());
  int64_t parts = 1;
  if (pairs < busy) parts = std::max<int64_t>(1, std::min((busy + pairs - 1) / pairs, max_ctx / kMinContextPart));
  const int64_t part_len = (max_ctx + parts - 1) / parts;
  // parts > 1: each item's statistics and unnormalised output, merged below
  std::vector<float> part_acc, part_max, part_sum;
  if (parts > 1) {
    part_acc.resize(pairs * parts * group * hd);
    part_max.resize(pairs * parts * group);
    part_sum.resize(pairs * parts * group);
  }
  at::parallel_for(0, pairs * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(group * hd * 2 + group * kAttentionTile + kAttentionTile * hd + 2 * group);
    float* q_f32 = scratch.data();
    float* acc_own = q_f32 + group * hd;
    float* scores = acc_own + group * hd;
    float* tile_f32 = scores + group * kAttentionTile;
    float* max_own = tile_f32 + kAttentionTile * hd;
    float* sum_own = max_own + group;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / (s.nkv * parts), kv_head = (item / parts) % s.nkv, part = item % parts;
      const int64_t row_begin = part * part_len, row_end = std::min(context_lens[i], row_begin + part_len);
      float* acc = parts > 1 ? part_acc.data() + item * group * hd : acc_own;
      float* row_max = parts > 1 ? part_max.data() + item * group : max_own;
      float* row_sum = parts > 1 ? part_sum.data() + item * group : sum_own;
      if (row_begin >= row_end) {       // a short sequence's empty part: merges with weight zero
        std::fill(row_sum, row_sum + group, 0.0f);
        continue;
      }
      auto attend = [&](auto head_dim) {
        attend_part<T, decltype(head_dim)::value>(
            q + i * q_s0 + kv_head * group * q_s1, q_s1, k_cache, v_cache, kv_head, page_stride, slot_stride,
            tables + i * table_stride, row_begin, row_end, s, scale, acc, row_max, row_sum, q_f32, scores,
            tile_f32);
      };
      switch (hd) {
        case 64: attend(std::integral_constant<int, 64>{}); break;
        case 128: attend(std::integral_constant<int, 128>{}); break;
        default: attend(std::integral_constant<int, 0>{}); break;
      }
      if (parts == 1) {
        for (int64_t g = 0; g < group; ++g) {
          T* o = out + i * out_s0 + (kv_head * group + g) * out_s1;
          const float inv = 1.0f / row_sum[g];
          for (int64_t d = 0; d < hd; ++d) o[d] = from_float<T>(acc[g * hd + d] * inv);
        }
      }
    }
  });
  if (parts == 1) return;
  at::parallel_for(0, s.n * s.nh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(hd);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / s.nh, head = item % s.nh, kv_head = head / group, g = head % group;
      const int64_t first = (i * s.nkv + kv_head) * parts;
      float global_max = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < parts; ++p)
        if (part_sum[(first + p) * group + g] > 0.0f) global_max = std::max(global_max, part_max[(first + p) * group + g]);
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t k = (first + p) * group + g;
        if (part_sum[k] == 0.0f) continue;
        const float w = exp_nonpositive(part_max[k] - global_max);
        total += w * part_sum[k];
        const float* a = part_acc.data() + k * hd;
        for (int64_t d = 0; d < hd; ++d) merged[d] += w * a[d];
      }
      T* o = out + i * out_s0 + head * out_s1;
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < hd; ++d) o[d] = from_float<T>(merged[d] * inv);
    }
  });
}

}  // namespace asyncserve
