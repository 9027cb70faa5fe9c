// LoRA of one projection group for a step's tokens, read in place from the pool's adapter rows
// (no stacks to build, no per-adapter GEMM call): for each run of consecutive tokens of one adapter
// and each projection of the group it targets,
//     s = scaling * x_run @ A^T        (its own rank only: no other adapter's columns, no mask)
//     y_run[:, cols] += s @ B          (B^T rows of fan_out elements)
// in fp32, y rounded to T once. Work items are (tile of up to kLoraTile tokens of a run,
// projection): each A and B row read serves the whole tile, and items write disjoint parts of y,
// so the threads take contiguous shares of equal cost and never meet at a barrier.
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>

#include "common.h"

namespace asyncserve {

constexpr int64_t kLoraTile = 8;                 // tokens sharing each weight row read
constexpr int64_t kLoraColumns = 32;             // y columns accumulated in registers per pass over B
// An item's cost: its multiply-adds, plus kLoraWeightMacs per weight element when it is the first
// tile of its run (the rows come from DRAM; the run's later tiles find them in cache). A decode
// step's few tokens per adapter read far more bytes than they multiply: counted by multiply-adds
// alone, the thread given a mixed step's cold decode items finished long after the one given its
// prefill tiles (31 adapters' decodes and a 224-token prefill, 30 layers of q and v: 6.6 ms, by
// cost 4.8 ms; box E). Below kLoraMinMacsPerThread a second thread costs more than it saves.
constexpr int64_t kLoraMinMacsPerThread = 65536;
constexpr int64_t kLoraWeightMacs = 4;

// The adapter tables (LoraBatch.tables() or SlotTables) and the layer to read: ranks [n, P];
// a_ptr, b_ptr [n, L, P, R] flat offsets of A rows and B^T rows; scaling [n, L, P].
struct LoraTables {
  const int32_t* ranks;
  const int64_t* a_ptr;
  const int64_t* b_ptr;
  const float* scaling;
  int64_t layers, projections, max_rank, layer;

  int64_t rank(int64_t adapter, int64_t proj) const { return ranks[adapter * projections + proj]; }
  int64_t at(int64_t adapter, int64_t proj) const { return (adapter * layers + layer) * projections + proj; }
  const int64_t* a_rows(int64_t adapter, int64_t proj) const { return a_ptr + at(adapter, proj) * max_rank; }
  const int64_t* b_rows(int64_t adapter, int64_t proj) const { return b_ptr + at(adapter, proj) * max_rank; }
};

// One projection of the group: its index in the tables, first column in y and width.
struct LoraProjection {
  int64_t index, column, fan_out;
};

// Tokens [begin, end) all use step adapter `adapter`.
struct LoraRun {
  int64_t begin, end, adapter;
};

// The pool rows lora_segments reads for these runs at tables.layer, for an earlier kernel to ask
// for (decoder.h): each run's adapter once, its A and B^T rows of every projection it targets, rows
// that lie end to end (the pager packs an adapter's rows in order) in one span. Offsets are not
// checked here: asking for a line reads nothing.
template <typename T>
std::vector<PrefetchSpan> lora_spans(const T* flat, const LoraTables& tables, const LoraRun* runs, int64_t num_runs,
                                     const LoraProjection* projs, int64_t num_projs, int64_t fan_in) {
  std::vector<PrefetchSpan> spans;
  std::vector<int64_t> adapters;
  auto add = [&](const int64_t* rows, int64_t r, int64_t width) {
    const int64_t bytes = width * int64_t(sizeof(T));
    for (int64_t j = 0; j < r; ++j) {
      const T* row = flat + rows[j];
      if (!spans.empty() && static_cast<const char*>(spans.back().data) + spans.back().bytes ==
                                reinterpret_cast<const char*>(row))
        spans.back().bytes += bytes;
      else
        spans.push_back({row, bytes});
    }
  };
  for (int64_t i = 0; i < num_runs; ++i) {
    const int64_t adapter = runs[i].adapter;
    if (std::find(adapters.begin(), adapters.end(), adapter) != adapters.end()) continue;
    adapters.push_back(adapter);
    for (int64_t p = 0; p < num_projs; ++p) {
      const int64_t r = tables.rank(adapter, projs[p].index);
      add(tables.a_rows(adapter, projs[p].index), r, fan_in);
      add(tables.b_rows(adapter, projs[p].index), r, projs[p].fan_out);
    }
  }
  return spans;
}

// s [N, r]: s[t][j] = scale * x_t . A_j for the tile's N token rows of x.
template <typename T, int N>
void lora_shrink(const T* x, int64_t x_stride, int64_t fan_in, const T* flat, const int64_t* a_rows, int64_t r,
                 float scale, float* s) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    // bf16 pairs straight into fp32 dot products: no conversion of x or A
    const __mmask32 tail = fan_in % 32 ? __mmask32((1u << (fan_in % 32)) - 1) : 0;
    const int64_t full = fan_in - fan_in % 32;
    for (int64_t j = 0; j < r; ++j) {
      const T* a = flat + a_rows[j];
      __m512 acc[N];
      for (int t = 0; t < N; ++t) acc[t] = _mm512_setzero_ps();
      for (int64_t k = 0; k < full; k += 32) {
        const __m512bh av = (__m512bh)_mm512_loadu_si512(a + k);
        for (int t = 0; t < N; ++t)
          acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_loadu_si512(x + t * x_stride + k), av);
      }
      if (tail) {
        const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(tail, a + full);
        for (int t = 0; t < N; ++t)
          acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + t * x_stride + full), av);
      }
      for (int t = 0; t < N; ++t) s[t * r + j] = _mm512_reduce_add_ps(acc[t]) * scale;
    }
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    // two accumulators per token: the tile's chains hide the FMA latency
    const __mmask16 tail = fan_in % 16 ? __mmask16((1u << (fan_in % 16)) - 1) : 0;
    const int64_t full = fan_in - fan_in % 32, half = fan_in - fan_in % 16;
    for (int64_t j = 0; j < r; ++j) {
      const float* a = flat + a_rows[j];
      __m512 acc[N][2];
      for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
      for (int64_t k = 0; k < full; k += 32) {
        const __m512 a0 = _mm512_loadu_ps(a + k), a1 = _mm512_loadu_ps(a + k + 16);
        for (int t = 0; t < N; ++t) {
          acc[t][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + t * x_stride + k), a0, acc[t][0]);
          acc[t][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + t * x_stride + k + 16), a1, acc[t][1]);
        }
      }
      if (half > full) {
        const __m512 a0 = _mm512_loadu_ps(a + full);
        for (int t = 0; t < N; ++t) acc[t][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + t * x_stride + full), a0, acc[t][0]);
      }
      if (tail) {
        const __m512 a0 = _mm512_maskz_loadu_ps(tail, a + half);
        for (int t = 0; t < N; ++t)
          acc[t][1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + t * x_stride + half), a0, acc[t][1]);
      }
      for (int t = 0; t < N; ++t) s[t * r + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1])) * scale;
    }
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    // one 8-lane accumulator per token in registers (the generic loop below kept its partial sums on
    // the stack here: W1's q/k/v LoRA of a 16-token decode step 117 us beyond the base GEMM, eager 86)
    const int64_t full = fan_in - fan_in % 8;
    for (int64_t j = 0; j < r; ++j) {
      const float* a = flat + a_rows[j];
      __m256 acc[N];
      for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t k = 0; k < full; k += 8) {
        const __m256 av = _mm256_loadu_ps(a + k);
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(x + t * x_stride + k), av, acc[t]);
      }
      for (int t = 0; t < N; ++t) {
        float dot = sum_lanes8(acc[t]);
        for (int64_t k = full; k < fan_in; ++k) dot += x[t * x_stride + k] * a[k];
        s[t * r + j] = dot * scale;
      }
    }
    return;
  }
#endif
  // other CPUs and dtypes: kLoraColumns partial sums per token (independent chains), summed at the end
  const int64_t full = fan_in - fan_in % kLoraColumns;
  for (int64_t j = 0; j < r; ++j) {
    const T* a = flat + a_rows[j];
    float acc[N][kLoraColumns] = {};
    float av[kLoraColumns];
    for (int64_t k = 0; k < full; k += kLoraColumns) {
#pragma omp simd
      for (int64_t c = 0; c < kLoraColumns; ++c) av[c] = to_float(a[k + c]);
      for (int t = 0; t < N; ++t) {
        const T* xt = x + t * x_stride + k;
#pragma omp simd
        for (int64_t c = 0; c < kLoraColumns; ++c) acc[t][c] += to_float(xt[c]) * av[c];
      }
    }
    for (int t = 0; t < N; ++t) {
      const T* xt = x + t * x_stride;
      float dot = 0.0f;
      for (int64_t k = full; k < fan_in; ++k) dot += to_float(xt[k]) * to_float(a[k]);
      for (int64_t c = 0; c < kLoraColumns; ++c) dot += acc[t][c];
      s[t * r + j] = dot * scale;
    }
  }
}

// y_t[c0 + c] += sum_j s[t][j] * B_j[c0 + c] for c < W (W == 0: a runtime width `width` < kLoraColumns,
// the tail), with the tile's accumulators in registers for the full blocks.
template <typename T, int N, int W>
inline void lora_expand_block(T* y, int64_t y_stride, const T* flat, const int64_t* b_rows, int64_t r,
                              const float* s, int64_t c0, int64_t width) {
  constexpr int64_t kWidth = W > 0 ? W : kLoraColumns;
  const int64_t w = W > 0 ? W : width;
  float acc[N][kWidth] = {};
  float b[kWidth];
  for (int64_t j = 0; j < r; ++j) {
    const T* row = flat + b_rows[j] + c0;
#pragma omp simd
    for (int64_t c = 0; c < w; ++c) b[c] = to_float(row[c]);
    for (int t = 0; t < N; ++t) {
      const float sv = s[t * r + j];
#pragma omp simd
      for (int64_t c = 0; c < w; ++c) acc[t][c] += sv * b[c];
    }
  }
  for (int t = 0; t < N; ++t) {
    T* yt = y + t * y_stride + c0;
#pragma omp simd
    for (int64_t c = 0; c < w; ++c) yt[c] = from_float<T>(to_float(yt[c]) + acc[t][c]);
  }
}

template <typename T, int N>
void lora_expand(T* y, int64_t y_stride, int64_t fan_out, const T* flat, const int64_t* b_rows, int64_t r,
                 const float* s) {
  int64_t c0 = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    // 8 columns of every token in registers per pass over B (as the shrink above, for the same reason)
    for (; c0 + 8 <= fan_out; c0 += 8) {
      __m256 acc[N];
      for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t j = 0; j < r; ++j) {
        const __m256 b = _mm256_loadu_ps(flat + b_rows[j] + c0);
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(s + t * r + j), b, acc[t]);
      }
      for (int t = 0; t < N; ++t) {
        float* yt = y + t * y_stride + c0;
        _mm256_storeu_ps(yt, _mm256_add_ps(_mm256_loadu_ps(yt), acc[t]));
      }
    }
    if (c0 < fan_out) lora_expand_block<T, N, 0>(y, y_stride, flat, b_rows, r, s, c0, fan_out - c0);
    return;
  }
#endif
  for (; c0 + kLoraColumns <= fan_out; c0 += kLoraColumns)
    lora_expand_block<T, N, kLoraColumns>(y, y_stride, flat, b_rows, r, s, c0, kLoraColumns);
  if (c0 < fan_out) lora_expand_block<T, N, 0>(y, y_stride, flat, b_rows, r, s, c0, fan_out - c0);
}

template <typename T, int N>
void lora_tile(T* y, int64_t y_stride, const T* x, int64_t x_stride, int64_t fan_in, const T* flat,
               const LoraTables& tables, int64_t adapter, const LoraProjection& p, float* s) {
  const int64_t r = tables.rank(adapter, p.index);
  const float scale = tables.scaling[tables.at(adapter, p.index)];
  const int64_t* a_rows = tables.a_rows(adapter, p.index);
  const int64_t* b_rows = tables.b_rows(adapter, p.index);
  // all the item's rows at once: they are cold (a step reads each adapter's rows once) and the
  // shrink's dot products would otherwise wait for them row after row (a decode step's LoRA of W1 at
  // 4 tokens: 1.31 -> 0.85 ms, with the second thread below). Into L1 as well as L2: a decode step
  // of 31 adapters' q and v rows from DRAM took 2.2 ms against 2.6 ms with L2 alone (box E).
  for (int64_t j = 0; j < r; ++j) prefetch_row<3>(flat + a_rows[j], fan_in * int64_t(sizeof(T)));
  for (int64_t j = 0; j < r; ++j) prefetch_row<3>(flat + b_rows[j], p.fan_out * int64_t(sizeof(T)));
  lora_shrink<T, N>(x, x_stride, fan_in, flat, a_rows, r, scale, s);
  lora_expand<T, N>(y + p.column, y_stride, p.fan_out, flat, b_rows, r, s);
}

// y: [tokens, out] (row stride y_stride), x: [tokens, fan_in] (row stride x_stride); flat: the pool.
// Tokens outside every run are left as they are.
template <typename T>
void lora_segments(T* y, int64_t y_stride, const T* x, int64_t x_stride, int64_t fan_in, const T* flat,
                   const LoraTables& tables, const LoraRun* runs, int64_t num_runs, const LoraProjection* projs,
                   int64_t num_projs) {
  struct Item {
    int64_t begin, tokens, adapter, proj, cost;
  };
  std::vector<Item> items;
  int64_t total = 0, max_rank = 1;
  for (int64_t i = 0; i < num_runs; ++i) {
    for (int64_t t = runs[i].begin; t < runs[i].end; t += kLoraTile) {
      const int64_t tokens = std::min(kLoraTile, runs[i].end - t);
      for (int64_t p = 0; p < num_projs; ++p) {
        const int64_t r = tables.rank(runs[i].adapter, projs[p].index);
        if (r == 0) continue;
        const int64_t weights = r * (fan_in + projs[p].fan_out);
        const int64_t cost = tokens * weights + (t == runs[i].begin ? kLoraWeightMacs * weights : 0);
        items.push_back({t, tokens, runs[i].adapter, p, cost});
        total += cost;
        max_rank = std::max(max_rank, r);
      }
    }
  }
  if (items.empty()) return;
  // contiguous shares of about equal cost, one per thread
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / kLoraMinMacsPerThread));
  std::vector<int64_t> first(parts + 1, int64_t(items.size()));
  first[0] = 0;
  for (int64_t i = 0, part = 1, done = 0; i < int64_t(items.size()) && part < parts; ++i) {
    done += items[i].cost;
    if (done * parts >= total * part) first[part++] = i + 1;
  }
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(kLoraTile * max_rank);
    for (int64_t i = first[begin]; i < first[end]; ++i) {
      const Item& it = items[i];
      T* yt = y + it.begin * y_stride;
      const T* xt = x + it.begin * x_stride;
      const LoraProjection& p = projs[it.proj];
      switch (it.tokens) {
#define ASYNCSERVE_LORA_TILE(N) \
  case N: lora_tile<T, N>(yt, y_stride, xt, x_stride, fan_in, flat, tables, it.adapter, p, s.data()); break;
        ASYNCSERVE_LORA_TILE(1) ASYNCSERVE_LORA_TILE(2) ASYNCSERVE_LORA_TILE(3) ASYNCSERVE_LORA_TILE(4)
        ASYNCSERVE_LORA_TILE(5) ASYNCSERVE_LORA_TILE(6) ASYNCSERVE_LORA_TILE(7) ASYNCSERVE_LORA_TILE(8)
#undef ASYNCSERVE_LORA_TILE
      }
    }
  });
}

}  // namespace asyncserve
