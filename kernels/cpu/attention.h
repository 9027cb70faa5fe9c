// Paged decode attention: one query token per sequence against its cached K/V pages, read in place
// through the block table (no gather copy). Work items are (sequence, context part, KV heads): with
// sequences enough to share out, an item takes all of a row's KV heads, so it walks each page's
// rows in order (the pages are scattered and cold: every step streams the weights in between, so
// the rows come from DRAM and want long sequential runs and prefetches well ahead); with fewer,
// one KV head per item, and contexts are split into parts (flash-decoding) whose partial results
// are merged by their softmax statistics. The group of query heads that shares a KV head is
// computed together, so each K/V row is read once for the group. Rows past a sequence's context
// length are never read, so stale or uninitialised pool slots cannot leak in. fp32 accumulation.
// A sliding window (a query sees its last `window` rows, its own included) starts each context
// there: rows before it are never read either. Scores may be soft-capped (Gemma 2: cap *
// tanh(score / cap), before the softmax).
//
// On CPUs with AVX-512 (F, BW, VL; the build is -march=native per CPU, as for lora.h, so this is
// chosen at build time for the machine that runs it) an item walks its rows in chunks of up to
// kDecodeChunk, with one online-softmax update per chunk:
//   1. scores, 16 rows at a time: per query head, each row's q.k accumulates vertically in one
//      register of partial sums (bf16: AVX512-BF16 dot products of q and K pairs as they lie in
//      the cache, q not rounded (it is bf16 already; the scale is applied to the sums); without
//      AVX512-BF16, or fp32: FMAs), and a shuffle/add tree reduces the 16 registers into one
//      register of 16 scores (instead of 16 horizontal sums); a lane-wise running max per head;
//   2. per head: one horizontal max, one rescale factor for the state so far, then p = exp(s - max)
//      16 lanes at a time (exact zeros for lanes past the chunk) and one horizontal sum;
//   3. P.V in fp32 FMAs with up to 4 heads x 64 columns of accumulators in registers over all the
//      chunk's rows: each V row is read (and bf16 widened, by an exact shift and mask) once for
//      those heads and multiplied by each head's probability.
// CPUs with AVX2 and FMA run the same design in 8-lane registers (attend_part_avx2) where the head
// size is a multiple of 8. Other CPUs run the portable loops below (gcc vectorises them for their
// width): per tile of rows inside a page, K and V widened to fp32 scratch, one dot product per (head, row).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ASYNCSERVE_DECODE_AVX512 1
#define ASYNCSERVE_DECODE_AVX2 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define ASYNCSERVE_DECODE_AVX512 0
#define ASYNCSERVE_DECODE_AVX2 1
#include <immintrin.h>
#else
#define ASYNCSERVE_DECODE_AVX512 0
#define ASYNCSERVE_DECODE_AVX2 0
#endif

#include "common.h"

namespace asyncserve {

constexpr int64_t kAttentionTile = 32;        // rows scored before their values are accumulated
constexpr int64_t kMinContextPart = 128;      // shortest context part worth its own work item
constexpr int64_t kAheadRows = 32;            // K rows asked for (into L2) this far ahead of their use (16, 64: slower)

struct DecodeAttentionShape {
  int64_t n, nh, nkv, hd, block;
};

// The portable path (other CPUs: gcc vectorises it for their width).
// One (sequence, KV head, part): the group's softmax state over rows [row_begin, row_end).
// q: the group's first query row (query head rows q_head_stride apart); table: this sequence's
// block table. On return acc holds the unnormalised sum of p * v, row_max/row_sum the statistics.
// HD > 0 is head_dim known at compile time (the common sizes: unrolled loops, acc in registers);
// HD == 0 reads it from the shape. Scratch: q_f32 [group * hd], scores [group * tile],
// tile_f32 [tile * hd].
template <typename T, int HD>
void attend_part(const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache, int64_t kv_head,
                 int64_t page_stride, int64_t slot_stride, const int64_t* table, int64_t row_begin,
                 int64_t row_end, const DecodeAttentionShape& s, float scale, float softcap,
                 float* __restrict__ acc, float* row_max, float* row_sum, float* __restrict__ q_f32,
                 float* __restrict__ scores, float* __restrict__ tile_f32) {
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
      if (softcap > 0.0f) soft_cap(scores + g * kAttentionTile, rows, softcap);
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

// The vector paths' shared steps (attend_part_avx512, attend_part_avx2).

// The empty softmax state of `heads` heads: no rows seen.
inline void start_heads(float* acc, float* row_max, float* row_sum, int64_t heads, int64_t hd) {
  for (int64_t g = 0; g < heads; ++g) {
    row_max[g] = -std::numeric_limits<float>::infinity();
    row_sum[g] = 0.0f;
  }
  std::fill(acc, acc + heads * hd, 0.0f);
}

// offsets[j] = where rows t0 + j (j < n) of KV head kv_head start in the cache, through the block table.
inline void row_offsets(int64_t* offsets, int64_t t0, int64_t n, const int64_t* table, const DecodeAttentionShape& s,
                        int64_t page_stride, int64_t slot_stride, int64_t kv_head) {
  for (int64_t j = 0, page = t0 / s.block, slot = t0 % s.block; j < n; ++j) {
    offsets[j] = table[page] * page_stride + slot * slot_stride + kv_head * s.hd;
    if (++slot == s.block) {
      slot = 0;
      ++page;
    }
  }
}

// pv(H, g, h) for each KV head h < kv_heads and its query heads in blocks of up to 4 from head g, H (their
// count) as a compile-time constant: P.V with a block's accumulators in registers.
template <typename PV>
inline void over_head_blocks(int64_t kv_heads, int64_t group, PV pv) {
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t g = h * group; g < (h + 1) * group; g += 4) switch (std::min<int64_t>(4, (h + 1) * group - g)) {
        case 1: pv(std::integral_constant<int, 1>{}, g, h); break;
        case 2: pv(std::integral_constant<int, 2>{}, g, h); break;
        case 3: pv(std::integral_constant<int, 3>{}, g, h); break;
        default: pv(std::integral_constant<int, 4>{}, g, h); break;
      }
}

#if ASYNCSERVE_DECODE_AVX512
// AVX-512 path (see the top of the file).
constexpr int kDecodeRows = 16;                // rows scored together: one register of scores
constexpr int64_t kDecodeChunk = 256;   // rows per softmax update: their scores are kept, then weighted

// reduce_rows puts the sum of v[kRowSlot[j]] in lane j (the map is its own inverse).
constexpr int kRowSlot[kDecodeRows] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

inline __m512 reduce_rows(const __m512* v) {
  __m512 w[8], u[4], h[2];
  for (int i = 0; i < 8; ++i)     // 256-bit halves: row i in chunks 0-1, row i + 8 in chunks 2-3
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)     // 128-bit chunks: rows i, i + 8, i + 4, i + 12
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)     // pairs of lanes
    h[i] = _mm512_add_ps(_mm512_shuffle_ps(u[i], u[i + 2], 0x44), _mm512_shuffle_ps(u[i], u[i + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(h[0], h[1], 0x88), _mm512_shuffle_ps(h[0], h[1], 0xDD));
}

// exp_nonpositive on 16 lanes (the same reduction and polynomial; NaN stays NaN).
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);           // returns x when x is NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 y = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  y = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), y);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// How scores multiply and add: W elements of q and K per step (a masked load for the tail).
template <typename T>
struct DecodeDot;

template <>
struct DecodeDot<float> {
  static constexpr int W = 16;
  using V = __m512;
  static V load(const float* p, __mmask32 m) { return _mm512_maskz_loadu_ps(__mmask16(m), p); }
  static __m512 madd(__m512 acc, V q, V k) { return _mm512_fmadd_ps(q, k, acc); }
};

#if defined(__AVX512BF16__)
template <>
struct DecodeDot<bf16> {   // pairs of bf16 straight into fp32 dot products (the products are exact)
  static constexpr int W = 32;
  using V = __m512i;
  static V load(const bf16* p, __mmask32 m) { return _mm512_maskz_loadu_epi16(m, p); }
  static __m512 madd(__m512 acc, V q, V k) { return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)k); }
};
#else
template <>
struct DecodeDot<bf16> {   // AVX-512 without BF16: widened to fp32 on load
  static constexpr int W = 16;
  using V = __m512;
  static V load(const bf16* p, __mmask32 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(__mmask16(m), p)), 16));
  }
  static __m512 madd(__m512 acc, V q, V k) { return _mm512_fmadd_ps(q, k, acc); }
};
#endif

// P.V, fp32 V: acc[h][c0 .. c0 + 16 C) = acc * correction[h] + sum_j p[h][j] * v_j[c0 ..] over the
// chunk's rows, heads h < H (acc rows hd apart, p rows kDecodeChunk apart); `last` masks the last
// 16 columns. H x C accumulators in registers (independent FMA chains), each V row read once.
template <int H, int C>
inline void accumulate_values(const float* v_cache, const int64_t* offsets, int64_t rows, int64_t c0,
                              __mmask16 last, const float* p, const float* correction, float* acc, int64_t hd) {
  __m512 a[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c)
      a[h][c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(c + 1 < C ? __mmask16(0xffff) : last, acc + h * hd + c0 + 16 * c),
                              _mm512_set1_ps(correction[h]));
  for (int64_t j = 0; j < rows; ++j) {
    const float* row = v_cache + offsets[j] + c0;
    for (int c = 0; c < C; ++c) {
      const __m512 v = _mm512_maskz_loadu_ps(c + 1 < C ? __mmask16(0xffff) : last, row + 16 * c);
      for (int h = 0; h < H; ++h) a[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * kDecodeChunk + j]), v, a[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c)
      _mm512_mask_storeu_ps(acc + h * hd + c0 + 16 * c, c + 1 < C ? __mmask16(0xffff) : last, a[h][c]);
}

template <int H>
inline void accumulate_values_heads(const float* v_cache, const int64_t* offsets, int64_t rows, int64_t hd,
                                    const float* p, const float* correction, float* acc) {
  const int64_t steps = (hd + 15) / 16, tail = hd - (steps - 1) * 16;
  const __mmask16 tail_mask = __mmask16((1u << tail) - 1);
  for (int64_t c = 0; c < steps; c += 4) {      // at most 4 x 4 accumulators
    const int64_t n = std::min<int64_t>(4, steps - c);
    const __mmask16 last = c + n < steps ? __mmask16(0xffff) : tail_mask;
    switch (n) {
      case 1: accumulate_values<H, 1>(v_cache, offsets, rows, c * 16, last, p, correction, acc, hd); break;
      case 2: accumulate_values<H, 2>(v_cache, offsets, rows, c * 16, last, p, correction, acc, hd); break;
      case 3: accumulate_values<H, 3>(v_cache, offsets, rows, c * 16, last, p, correction, acc, hd); break;
      default: accumulate_values<H, 4>(v_cache, offsets, rows, c * 16, last, p, correction, acc, hd); break;
    }
  }
}

// P.V, bf16 V: 32 columns per load, split exactly into their even and odd columns as fp32 (a shift
// and a mask: two operations per 32 values); acc is read and written in its natural order and
// de-interleaved into even/odd registers for the rows in between. C steps of 32 columns from c0;
// `last` masks the last step's columns. (Dot products of bf16 pairs of rows would need p rounded
// to bf16, and measured slower on Zen 4 than these FMAs.)
template <int H, int C>
inline void accumulate_values_pairs(const bf16* v_cache, const int64_t* offsets, int64_t rows, int64_t c0,
                                    __mmask32 last, const float* p, const float* correction, float* acc, int64_t hd) {
  const __m512i even_index = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd_index = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i low_index = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high_index = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512i high_half = _mm512_set1_epi32(int(0xffff0000u));
  __m512 even[H][C], odd[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) {
      const __mmask32 m = c + 1 < C ? ~__mmask32(0) : last;
      const float* a = acc + h * hd + c0 + 32 * c;
      const __m512 scale = _mm512_set1_ps(correction[h]);
      const __m512 lo = _mm512_maskz_loadu_ps(__mmask16(m), a), hi = _mm512_maskz_loadu_ps(__mmask16(m >> 16), a + 16);
      even[h][c] = _mm512_mul_ps(_mm512_permutex2var_ps(lo, even_index, hi), scale);
      odd[h][c] = _mm512_mul_ps(_mm512_permutex2var_ps(lo, odd_index, hi), scale);
    }
  for (int64_t j = 0; j < rows; ++j) {
    const bf16* row = v_cache + offsets[j] + c0;
    for (int c = 0; c < C; ++c) {
      const __m512i x = _mm512_maskz_loadu_epi16(c + 1 < C ? ~__mmask32(0) : last, row + 32 * c);
      const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(x, high_half));
      for (int h = 0; h < H; ++h) {
        const __m512 ph = _mm512_set1_ps(p[h * kDecodeChunk + j]);
        even[h][c] = _mm512_fmadd_ps(ph, ve, even[h][c]);
        odd[h][c] = _mm512_fmadd_ps(ph, vo, odd[h][c]);
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) {
      const __mmask32 m = c + 1 < C ? ~__mmask32(0) : last;
      float* a = acc + h * hd + c0 + 32 * c;
      _mm512_mask_storeu_ps(a, __mmask16(m), _mm512_permutex2var_ps(even[h][c], low_index, odd[h][c]));
      _mm512_mask_storeu_ps(a + 16, __mmask16(m >> 16), _mm512_permutex2var_ps(even[h][c], high_index, odd[h][c]));
    }
}

template <int H>
inline void accumulate_values_heads(const bf16* v_cache, const int64_t* offsets, int64_t rows, int64_t hd,
                                    const float* p, const float* correction, float* acc) {
  const int64_t steps = (hd + 31) / 32, tail = hd - (steps - 1) * 32;
  const __mmask32 tail_mask = tail == 32 ? ~__mmask32(0) : __mmask32((1u << tail) - 1);
  for (int64_t c = 0; c < steps; c += 2) {      // at most 4 x 2 x 2 accumulators
    const int64_t n = std::min<int64_t>(2, steps - c);
    const __mmask32 last = c + n < steps ? ~__mmask32(0) : tail_mask;
    if (n == 1)
      accumulate_values_pairs<H, 1>(v_cache, offsets, rows, c * 32, last, p, correction, acc, hd);
    else
      accumulate_values_pairs<H, 2>(v_cache, offsets, rows, c * 32, last, p, correction, acc, hd);
  }
}

// attend_part's contract for KV heads [kv_head, kv_head + kv_heads) at once: their heads' q rows are
// consecutive (q_head_stride apart) and so are their acc, row_max and row_sum entries. Taking a
// row's KV heads together walks the pages once, row after row, while one KV head per item (when
// the step has too few rows to share out otherwise) reads a strided slice of each row. softcap > 0
// caps the scores as attend_part does. Scratch:
// scores [heads * kDecodeChunk], head_max [heads * 16] (lanes of running maxima), correction [heads].
template <typename T, int HD>
void attend_part_avx512(const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache, int64_t kv_head,
                        int64_t kv_heads, int64_t page_stride, int64_t slot_stride, const int64_t* table,
                        int64_t row_begin, int64_t row_end, const DecodeAttentionShape& s, float scale,
                        float softcap, float* __restrict__ acc, float* row_max, float* row_sum, float* __restrict__ scores,
                        float* __restrict__ head_max, float* __restrict__ correction) {
  using Dot = DecodeDot<T>;
  constexpr int W = Dot::W;
  const int64_t group = s.nh / s.nkv, hd = HD > 0 ? HD : s.hd, heads = kv_heads * group;
  const int64_t chunks = (hd + W - 1) / W, tail = hd - (chunks - 1) * W;   // q/K steps; the last one's width
  const __mmask32 tail_mask = tail == 32 ? ~__mmask32(0) : __mmask32((1u << tail) - 1);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t slice_bytes = hd * int64_t(sizeof(T));
  start_heads(acc, row_max, row_sum, heads, hd);
  int64_t offsets[kDecodeChunk];      // the rows' first element of KV head kv_head
  for (int64_t t0 = row_begin; t0 < row_end; t0 += kDecodeChunk) {
    const int64_t n = std::min(kDecodeChunk, row_end - t0);
    row_offsets(offsets, t0, n, table, s, page_stride, slot_stride, kv_head);
    // scores of the chunk's rows, 16 at a time, and each head's lane-wise running max
    for (int64_t g = 0; g < heads; ++g) _mm512_storeu_ps(head_max + g * 16, minus_inf);
    for (int64_t j0 = 0; j0 < n; j0 += kDecodeRows) {
      const int64_t rows = std::min<int64_t>(kDecodeRows, n - j0);
      const __mmask16 valid = __mmask16((1u << rows) - 1);
      const int64_t ahead = std::max<int64_t>(0, std::min<int64_t>(kDecodeRows, n - j0 - kAheadRows));
      for (int64_t g = 0; g < heads; ++g) {
        const T* qg = q + g * q_head_stride;
        const int64_t kv = (g / group) * hd;          // this head's KV slice, from offsets
        __m512 partial[kDecodeRows];
#pragma GCC unroll 16
        for (int j = 0; j < kDecodeRows; ++j) {
          // the rows come from scattered pages, in the cache only if this step wrote them: the first
          // head of each KV head asks for its slice of the next tile's K rows and of this tile's V
          // rows (read after the chunk's softmax), spread over the dot products so they overlap
          if (g % group == 0) {
            if (j < ahead) prefetch_row<2>(k_cache + offsets[j0 + kAheadRows + j] + kv, slice_bytes);
            if (j < rows) prefetch_row<2>(v_cache + offsets[j0 + j] + kv, slice_bytes);
          }
          __m512 sum = _mm512_setzero_ps();
          if (j < rows) {       // rows past the context are never read
            const T* k = k_cache + offsets[j0 + j] + kv;
            for (int64_t c = 0; c + 1 < chunks; ++c)
              sum = Dot::madd(sum, Dot::load(qg + c * W, ~__mmask32(0)), Dot::load(k + c * W, ~__mmask32(0)));
            sum = Dot::madd(sum, Dot::load(qg + (chunks - 1) * W, tail_mask),
                            Dot::load(k + (chunks - 1) * W, tail_mask));
          }
          partial[kRowSlot[j]] = sum;
        }
        __m512 raw = _mm512_mul_ps(reduce_rows(partial), _mm512_set1_ps(scale));
        if (softcap > 0.0f) {
          alignas(64) float lanes[kDecodeRows];
          _mm512_store_ps(lanes, raw);
          soft_cap(lanes, kDecodeRows, softcap);
          raw = _mm512_load_ps(lanes);
        }
        const __m512 sc = _mm512_mask_blend_ps(valid, minus_inf, raw);
        _mm512_storeu_ps(scores + g * kDecodeChunk + j0, sc);
        _mm512_storeu_ps(head_max + g * 16, _mm512_max_ps(_mm512_loadu_ps(head_max + g * 16), sc));
      }
    }
    // one softmax update per head for the chunk: probabilities in place of the scores
    for (int64_t g = 0; g < heads; ++g) {
      float* sg = scores + g * kDecodeChunk;
      const float new_max = std::max(row_max[g], _mm512_reduce_max_ps(_mm512_loadu_ps(head_max + g * 16)));
      // exp(-inf) on the first chunk: clamped to ~1e-38, times a zero sum and zero acc
      correction[g] = exp_nonpositive(row_max[g] - new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j0 = 0; j0 < n; j0 += kDecodeRows) {
        const __mmask16 valid = __mmask16((1u << std::min<int64_t>(kDecodeRows, n - j0)) - 1);
        const __m512 p = _mm512_maskz_mov_ps(
            valid, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sg + j0), _mm512_set1_ps(new_max))));
        _mm512_storeu_ps(sg + j0, p);
        sum = _mm512_add_ps(sum, p);
      }
      row_sum[g] = row_sum[g] * correction[g] + _mm512_reduce_add_ps(sum);
      row_max[g] = new_max;
    }
    // per KV head, its group's heads over its V slice, at most 4 heads a pass
    over_head_blocks(kv_heads, group, [&](auto heads_in_block, int64_t g, int64_t h) {
      accumulate_values_heads<decltype(heads_in_block)::value>(v_cache + h * hd, offsets, n, hd,
                                                               scores + g * kDecodeChunk, correction + g, acc + g * hd);
    });
  }
}
#endif

#if ASYNCSERVE_DECODE_AVX2
// AVX2 path: the AVX-512 path's structure in 8-lane registers, for head sizes that are a multiple of
// 8 (others run the portable loops): scores 8 rows at a time (per row a register of partial sums
// over the head, the 8 reduced into one register of 8 scores by a hadd tree), one softmax update per
// chunk of rows, P.V with up to 4 heads x 12 registers of columns accumulating over the chunk's
// rows. K and V are fp32 (bf16 widened exactly on load). Against the portable loops on 2 Zen 3 cores
// (32 heads over 8 KV heads of 64): 2.5x for 16 sequences of 120 rows, 2x for one of 2,000, 1.2x for
// 16 of 2,000 (their K/V stream from DRAM).
constexpr int kDecodeRows = 8;                 // rows scored together: one register of scores
constexpr int64_t kDecodeChunk = 256;          // rows per softmax update

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// lane j = the sum of v[j]'s lanes
inline __m256 reduce_rows8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);   // rows 0-3 | 4-7, per 128-bit half
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// exp_nonpositive on 8 lanes (the same reduction and polynomial; NaN stays NaN).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);           // returns x when x is NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 y = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  y = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), y);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));   // n >= -126 after the clamp: a normal 2^n
}

// P.V: acc[h][c0 .. c0 + 8 C) = acc * correction[h] + sum_j p[h][j] * v_j[c0 ..] over the chunk's rows,
// heads h < H (acc rows hd apart, p rows kDecodeChunk apart); H x C accumulators in registers.
template <typename T, int H, int C>
inline void accumulate_values8(const T* v_cache, const int64_t* offsets, int64_t rows, int64_t c0, const float* p,
                               const float* correction, float* acc, int64_t hd) {
  __m256 a[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c)
      a[h][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * hd + c0 + 8 * c), _mm256_set1_ps(correction[h]));
  for (int64_t j = 0; j < rows; ++j) {
    const T* row = v_cache + offsets[j] + c0;
    __m256 ph[H];
    for (int h = 0; h < H; ++h) ph[h] = _mm256_broadcast_ss(p + h * kDecodeChunk + j);
    for (int c = 0; c < C; ++c) {
      const __m256 v = load8(row + 8 * c);
      for (int h = 0; h < H; ++h) a[h][c] = _mm256_fmadd_ps(ph[h], v, a[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + h * hd + c0 + 8 * c, a[h][c]);
}

template <typename T, int H>
inline void accumulate_values8_heads(const T* v_cache, const int64_t* offsets, int64_t rows, int64_t hd,
                                     const float* p, const float* correction, float* acc) {
  constexpr int kMaxC = H == 1 ? 8 : H == 4 ? 2 : 12 / H;   // accumulators + one V + H probabilities <= 16 registers
  const int64_t chunks = hd / 8;
  for (int64_t c = 0; c < chunks; c += kMaxC) {
    const int64_t n = std::min<int64_t>(kMaxC, chunks - c);
    switch (n) {
#define ASYNCSERVE_ACCUMULATE_CASE(N) \
      case N: if constexpr (N <= kMaxC) accumulate_values8<T, H, N>(v_cache, offsets, rows, c * 8, p, correction, acc, hd); break;
      ASYNCSERVE_ACCUMULATE_CASE(1) ASYNCSERVE_ACCUMULATE_CASE(2) ASYNCSERVE_ACCUMULATE_CASE(3)
      ASYNCSERVE_ACCUMULATE_CASE(4) ASYNCSERVE_ACCUMULATE_CASE(5) ASYNCSERVE_ACCUMULATE_CASE(6)
      ASYNCSERVE_ACCUMULATE_CASE(7) ASYNCSERVE_ACCUMULATE_CASE(8)
#undef ASYNCSERVE_ACCUMULATE_CASE
    }
  }
}

// attend_part_avx512's contract (KV heads [kv_head, kv_head + kv_heads) at once), hd % 8 == 0.
// Scratch: scores [heads * kDecodeChunk], head_max [heads * 16] (8 lanes used), correction [heads].
template <typename T, int HD>
void attend_part_avx2(const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache, int64_t kv_head,
                      int64_t kv_heads, int64_t page_stride, int64_t slot_stride, const int64_t* table,
                      int64_t row_begin, int64_t row_end, const DecodeAttentionShape& s, float scale,
                      float softcap, float* __restrict__ acc, float* row_max, float* row_sum, float* __restrict__ scores,
                      float* __restrict__ head_max, float* __restrict__ correction) {
  const int64_t group = s.nh / s.nkv, hd = HD > 0 ? HD : s.hd, heads = kv_heads * group, chunks = hd / 8;
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t slice_bytes = hd * int64_t(sizeof(T));
  start_heads(acc, row_max, row_sum, heads, hd);
  int64_t offsets[kDecodeChunk];      // the rows' first element of KV head kv_head
  for (int64_t t0 = row_begin; t0 < row_end; t0 += kDecodeChunk) {
    const int64_t n = std::min(kDecodeChunk, row_end - t0);
    row_offsets(offsets, t0, n, table, s, page_stride, slot_stride, kv_head);
    for (int64_t g = 0; g < heads; ++g) _mm256_storeu_ps(head_max + g * 16, minus_inf);
    for (int64_t j0 = 0; j0 < n; j0 += kDecodeRows) {
      const int64_t rows = std::min<int64_t>(kDecodeRows, n - j0);
      const int64_t ahead = std::max<int64_t>(0, std::min<int64_t>(kDecodeRows, n - j0 - kAheadRows));
      const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(rows)),
                                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      for (int64_t g = 0; g < heads; ++g) {
        const T* qg = q + g * q_head_stride;
        const int64_t kv = (g / group) * hd;          // this head's KV slice, from offsets
        if (g % group == 0)       // as the AVX-512 path: the next tiles' K rows, this tile's V rows
          for (int j = 0; j < kDecodeRows; ++j) {
            if (j < ahead) prefetch_row<2>(k_cache + offsets[j0 + kAheadRows + j] + kv, slice_bytes);
            if (j < rows) prefetch_row<2>(v_cache + offsets[j0 + j] + kv, slice_bytes);
          }
        const T* k[kDecodeRows];
        for (int j = 0; j < kDecodeRows; ++j) k[j] = k_cache + offsets[j0 + std::min<int64_t>(j, rows - 1)] + kv;
        __m256 partial[kDecodeRows];
        for (int j = 0; j < kDecodeRows; ++j) partial[j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) {   // rows past the context repeat the last one: masked below
          const __m256 qv = load8(qg + 8 * c);
#pragma GCC unroll 8
          for (int j = 0; j < kDecodeRows; ++j) partial[j] = _mm256_fmadd_ps(qv, load8(k[j] + 8 * c), partial[j]);
        }
        __m256 raw = _mm256_mul_ps(reduce_rows8(partial), _mm256_set1_ps(scale));
        if (softcap > 0.0f) {
          alignas(32) float lanes[kDecodeRows];
          _mm256_store_ps(lanes, raw);
          soft_cap(lanes, kDecodeRows, softcap);
          raw = _mm256_load_ps(lanes);
        }
        const __m256 sc = _mm256_blendv_ps(minus_inf, raw, valid);
        _mm256_storeu_ps(scores + g * kDecodeChunk + j0, sc);
        _mm256_storeu_ps(head_max + g * 16, _mm256_max_ps(_mm256_loadu_ps(head_max + g * 16), sc));
      }
    }
    for (int64_t g = 0; g < heads; ++g) {
      float* sg = scores + g * kDecodeChunk;
      const float new_max = std::max(row_max[g], reduce_max8(_mm256_loadu_ps(head_max + g * 16)));
      // exp(-inf) on the first chunk: clamped to ~1e-38, times a zero sum and zero acc
      correction[g] = exp_nonpositive(row_max[g] - new_max);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j0 = 0; j0 < n; j0 += kDecodeRows) {
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32(int(std::min<int64_t>(kDecodeRows, n - j0))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        const __m256 p = _mm256_and_ps(valid, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sg + j0), _mm256_set1_ps(new_max))));
        _mm256_storeu_ps(sg + j0, p);
        sum = _mm256_add_ps(sum, p);
      }
      row_sum[g] = row_sum[g] * correction[g] + sum_lanes8(sum);
      row_max[g] = new_max;
    }
    over_head_blocks(kv_heads, group, [&](auto heads_in_block, int64_t g, int64_t h) {
      accumulate_values8_heads<T, decltype(heads_in_block)::value>(v_cache + h * hd, offsets, n, hd,
                                                                   scores + g * kDecodeChunk, correction + g, acc + g * hd);
    });
  }
}
#endif

// out, q: [n, nh, hd] with row strides (*_s0, *_s1; hd contiguous). k_cache, v_cache: one layer's
// K and V; row `slot` of page p starts at p * page_stride + slot * slot_stride and holds nkv * hd
// values. tables: [n, table_stride] page ids; context_lens: [n], each >= 1. window > 0: each query
// attends to its context's last `window` rows only; softcap > 0: scores soft-capped.
template <typename T>
void paged_decode_attention(T* out, int64_t out_s0, int64_t out_s1, const T* q, int64_t q_s0, int64_t q_s1,
                            const T* k_cache, const T* v_cache, int64_t page_stride, int64_t slot_stride,
                            const int64_t* tables, int64_t table_stride, const int64_t* context_lens,
                            const DecodeAttentionShape& s, float scale, int64_t window, float softcap) {
  const int64_t group = s.nh / s.nkv, hd = s.hd;
  // sequence i attends to its rows [first_row(i), context_lens[i])
  auto first_row = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, context_lens[i] - window) : 0; };
  int64_t max_ctx = 1;      // the longest span of rows attended to
  for (int64_t i = 0; i < s.n; ++i) max_ctx = std::max(max_ctx, context_lens[i] - first_row(i));
  const int64_t threads = at::get_num_threads(), busy = 4 * threads;
  // Items are (sequence, context part, KV heads): all of a row's KV heads when there are sequences
  // enough to share out, else one KV head each, and with too few of those the contexts split too.
  const int64_t kv_per_item = s.n >= 2 * threads ? s.nkv : 1;
  const int64_t slices = s.nkv / kv_per_item, heads = kv_per_item * group;
  const int64_t pairs = s.n * slices;
  int64_t parts = 1;
  if (pairs < busy) parts = std::max<int64_t>(1, std::min((busy + pairs - 1) / pairs, max_ctx / kMinContextPart));
  const int64_t part_len = (max_ctx + parts - 1) / parts;
  // parts > 1: each (sequence, part, head)'s statistics and unnormalised output, merged below
  std::vector<float> part_acc, part_max, part_sum;
  if (parts > 1) {
    part_acc.resize(s.n * parts * s.nh * hd);
    part_max.resize(s.n * parts * s.nh);
    part_sum.resize(s.n * parts * s.nh);
  }
  at::parallel_for(0, pairs * parts, 1, [&](int64_t begin, int64_t end) {
#if ASYNCSERVE_DECODE_AVX512 || ASYNCSERVE_DECODE_AVX2
    std::vector<float> scratch(heads * hd + heads * kDecodeChunk + heads * 16 + 3 * heads);
    float* acc_own = scratch.data();
    float* scores = acc_own + heads * hd;
    float* head_max = scores + heads * kDecodeChunk;
    float* correction = head_max + heads * 16;
    float* max_own = correction + heads;
#else
    std::vector<float> scratch(heads * hd + 2 * heads);
    float* acc_own = scratch.data();
    float* max_own = acc_own + heads * hd;
#endif
#if !ASYNCSERVE_DECODE_AVX512    // the portable loops' (AVX2: for head sizes not a multiple of 8)
    std::vector<float> portable(group * hd + group * kAttentionTile + kAttentionTile * hd);
    float* q_f32 = portable.data();
    float* tile_scores = q_f32 + group * hd;
    float* tile_f32 = tile_scores + group * kAttentionTile;
#endif
    float* sum_own = max_own + heads;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / (slices * parts), part = (item / slices) % parts;
      const int64_t kv_head = item % slices * kv_per_item;
      const int64_t row_begin = first_row(i) + part * part_len;
      const int64_t row_end = std::min(context_lens[i], row_begin + part_len);
      const int64_t first_head = (i * parts + part) * s.nh + kv_head * group;   // in the part arrays
      float* acc = parts > 1 ? part_acc.data() + first_head * hd : acc_own;
      float* row_max = parts > 1 ? part_max.data() + first_head : max_own;
      float* row_sum = parts > 1 ? part_sum.data() + first_head : sum_own;
      if (row_begin >= row_end) {       // a short sequence's empty part: merges with weight zero
        std::fill(row_sum, row_sum + heads, 0.0f);
        continue;
      }
      // the next item's first rows, which it reads before its own prefetches run ahead of it
      if (item + 1 < end) {
        const int64_t next = item + 1, ni = next / (slices * parts), nkv_head = next % slices * kv_per_item;
        const int64_t first = first_row(ni) + (next / slices) % parts * part_len;
        const int64_t last = std::min(context_lens[ni], first + kAheadRows);
        for (int64_t t = first; t < last; ++t) {
          const int64_t offset = tables[ni * table_stride + t / s.block] * page_stride + (t % s.block) * slot_stride +
                                 nkv_head * hd;
          prefetch_row<2>(k_cache + offset, kv_per_item * hd * int64_t(sizeof(T)));
        }
      }
      const T* qi = q + i * q_s0 + kv_head * group * q_s1;
      const int64_t* table = tables + i * table_stride;
      auto attend = [&](auto head_dim) {
#if ASYNCSERVE_DECODE_AVX512
        attend_part_avx512<T, decltype(head_dim)::value>(qi, q_s1, k_cache, v_cache, kv_head, kv_per_item,
                                                         page_stride, slot_stride, table, row_begin, row_end, s,
                                                         scale, softcap, acc, row_max, row_sum, scores, head_max,
                                                         correction);
#else
#if ASYNCSERVE_DECODE_AVX2
        if (hd % 8 == 0) {
          attend_part_avx2<T, decltype(head_dim)::value>(qi, q_s1, k_cache, v_cache, kv_head, kv_per_item, page_stride,
                                                         slot_stride, table, row_begin, row_end, s, scale, softcap, acc,
                                                         row_max, row_sum, scores, head_max, correction);
          return;
        }
#endif
        for (int64_t h = 0; h < kv_per_item; ++h)
          attend_part<T, decltype(head_dim)::value>(
              qi + h * group * q_s1, q_s1, k_cache, v_cache, kv_head + h, page_stride, slot_stride, table, row_begin,
              row_end, s, scale, softcap, acc + h * group * hd, row_max + h * group, row_sum + h * group, q_f32,
              tile_scores, tile_f32);
#endif
      };
      switch (hd) {
        case 64: attend(std::integral_constant<int, 64>{}); break;
        case 128: attend(std::integral_constant<int, 128>{}); break;
        default: attend(std::integral_constant<int, 0>{}); break;
      }
      if (parts == 1) {
        for (int64_t g = 0; g < heads; ++g) {
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
      const int64_t i = item / s.nh, head = item % s.nh;
      float global_max = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t k = (i * parts + p) * s.nh + head;
        if (part_sum[k] > 0.0f) global_max = std::max(global_max, part_max[k]);
      }
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t k = (i * parts + p) * s.nh + head;
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
