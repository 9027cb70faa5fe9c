// Paged prefill attention: a step's prefill chunks, each query row attending causally to its
// sequence's cached pages and the chunk's own earlier rows, all read in place through the block
// table (the step's K/V are in the pool already: rope_write_kv ran first). Work items are
// (chunk, block of query rows, KV head): the item's query rows times the group's heads form the
// lanes m of small GEMMs against each tile of keys, computed transposed (scores [key, m], output
// [d, m]) so that the softmax statistics are per-lane vectors and K rows are used as they lie.
// bf16 runs the GEMMs as AVX512-BF16 dot products of pairs (where the CPU has them), fp32 as FMAs;
// online softmax over the tiles, fp32 accumulation. Keys past a row's own position are masked;
// keys past the item's last row are never read. With a sliding window (a row sees the last
// `window` positions, its own included) keys before a row's window are masked too, and those
// before the item's first row's window never read. Scores may be soft-capped (Gemma 2: cap *
// tanh(score / cap), before the mask).
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "common.h"

namespace asyncserve {

constexpr int64_t kPrefillKeyTile = 32;      // keys per tile
constexpr int64_t kPrefillQueryBlock = 16;   // query rows per work item (times the group's heads: the lanes)
constexpr int64_t kLanes = 16;               // floats per vector

// gcc's vector extension: 16 floats, one AVX-512 register (two on AVX2); `u` for unaligned access
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4)));

inline f32x16 load16(const float* p) { return *reinterpret_cast<const f32x16u*>(p); }
inline void store16(float* p, f32x16 v) { *reinterpret_cast<f32x16u*>(p) = v; }

// How gemm_block multiplies and adds: FMA of one fp32 A value broadcast with 16 fp32 lanes of B;
// or, with AVX512-BF16, dot products of bf16 pairs (two depth steps per instruction, twice the
// multiply-adds of an FMA): A elements and B lanes are then uint32 holding (lo, hi) bf16 pairs.
struct Fp32Madd {
  using Element = float;
  using Lanes = f32x16;
#if defined(__AVX512F__) || !defined(__AVX2__)
  static constexpr int kBlockRows = 8, kBlockVectors = 2;   // 16 of the 32 zmm registers accumulate
#else
  // gemm_block_ymm: 12 of the 16 ymm registers accumulate
  static constexpr int kBlockRows = 6, kBlockVectors = 1;
#endif
  static Lanes load(const float* p) { return load16(p); }
  static f32x16 madd(f32x16 c, float a, Lanes b) { return c + (f32x16{} + a) * b; }
};

#ifdef __AVX512BF16__
struct Bf16PairMadd {
  using Element = uint32_t;
  using Lanes = __m512bh;
  static constexpr int kBlockRows = 8, kBlockVectors = 2;
  static Lanes load(const uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static f32x16 madd(f32x16 c, uint32_t a, Lanes b) {
    return (f32x16)_mm512_dpbf16_ps((__m512)c, (__m512bh)_mm512_set1_epi32(int(a)), b);
  }
};
#else
struct Bf16PairMadd;   // only named in branches that kBf16Pairs discards on CPUs without AVX512-BF16
#endif

// c[a, m] = sum_b A[a * a_stride + b * b_stride] * B[b, m] for a < AB, m < 16 * MV, with
// ACCUMULATE plus C[a, m] * lane_scale[m] (the online softmax's rescaling of the output so far),
// else times out_scale. AB x MV accumulators in registers, each B row loaded once per block and
// each A value broadcast.
template <typename Madd, int AB, int MV, bool ACCUMULATE>
inline void gemm_block(const typename Madd::Element* A, int64_t a_stride, int64_t b_stride,
                       const typename Madd::Element* B, int64_t ldb, float* C, int64_t ldc, int64_t depth,
                       const float* lane_scale, float out_scale) {
  f32x16 c[AB][MV];
#pragma GCC unroll 16
  for (int a = 0; a < AB; ++a)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v)
      c[a][v] = ACCUMULATE ? load16(C + a * ldc + v * kLanes) * load16(lane_scale + v * kLanes) : f32x16{};
  for (int64_t b = 0; b < depth; ++b) {
    typename Madd::Lanes bv[MV];
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) bv[v] = Madd::load(B + b * ldb + v * kLanes);
#pragma GCC unroll 16
    for (int a = 0; a < AB; ++a) {
      const typename Madd::Element av = A[a * a_stride + b * b_stride];
#pragma GCC unroll 4
      for (int v = 0; v < MV; ++v) c[a][v] = Madd::madd(c[a][v], av, bv[v]);
    }
  }
#pragma GCC unroll 16
  for (int a = 0; a < AB; ++a)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) store16(C + a * ldc + v * kLanes, ACCUMULATE ? c[a][v] : c[a][v] * out_scale);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define ASYNCSERVE_PREFILL_YMM 1
// gemm_block for Fp32Madd in ymm registers. Without AVX-512 gcc keeps the f32x16 accumulators of the
// generic code on the stack and moves them through general registers every step (measured ~8x slower).
template <int AB, int MV, bool ACCUMULATE>
inline void gemm_block_ymm(const float* A, int64_t a_stride, int64_t b_stride, const float* B, int64_t ldb, float* C,
                           int64_t ldc, int64_t depth, const float* lane_scale, float out_scale) {
  constexpr int V = 2 * MV;   // ymm registers per row of the block
  __m256 c[AB][V];
  for (int a = 0; a < AB; ++a)
    for (int v = 0; v < V; ++v)
      c[a][v] = ACCUMULATE ? _mm256_mul_ps(_mm256_loadu_ps(C + a * ldc + 8 * v), _mm256_loadu_ps(lane_scale + 8 * v))
                           : _mm256_setzero_ps();
  for (int64_t b = 0; b < depth; ++b) {
    __m256 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = _mm256_loadu_ps(B + b * ldb + 8 * v);
    for (int a = 0; a < AB; ++a) {
      const __m256 av = _mm256_broadcast_ss(A + a * a_stride + b * b_stride);
      for (int v = 0; v < V; ++v) c[a][v] = _mm256_fmadd_ps(av, bv[v], c[a][v]);
    }
  }
  const __m256 scale = _mm256_set1_ps(out_scale);
  for (int a = 0; a < AB; ++a)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(C + a * ldc + 8 * v, ACCUMULATE ? c[a][v] : _mm256_mul_ps(c[a][v], scale));
}
#endif

// C [rows_a, lanes] = A (rows_a x depth, strided) . B [depth, lanes] (+ C * lane_scale, or times
// out_scale: see gemm_block); lanes a multiple of 16. Blocks of Madd's kBlockRows x kBlockVectors.
template <typename Madd, bool ACCUMULATE>
void gemm_lanes(const typename Madd::Element* A, int64_t a_stride, int64_t b_stride, const typename Madd::Element* B,
                float* C, int64_t rows_a, int64_t lanes, int64_t depth, const float* lane_scale, float out_scale) {
  constexpr int AB = Madd::kBlockRows, MV = Madd::kBlockVectors;
  const auto block = [&](auto rows, auto vectors, int64_t a, int64_t m) {
    constexpr int R = decltype(rows)::value, V = decltype(vectors)::value;
#ifdef ASYNCSERVE_PREFILL_YMM
    if constexpr (std::is_same_v<Madd, Fp32Madd>) {
      gemm_block_ymm<R, V, ACCUMULATE>(A + a * a_stride, a_stride, b_stride, B + m, lanes, C + a * lanes + m, lanes,
                                       depth, lane_scale + m, out_scale);
      return;
    }
#endif
    gemm_block<Madd, R, V, ACCUMULATE>(A + a * a_stride, a_stride, b_stride, B + m, lanes, C + a * lanes + m, lanes,
                                       depth, lane_scale + m, out_scale);
  };
  int64_t a = 0;
  for (; a + AB <= rows_a; a += AB) {
    int64_t m = 0;
    for (; m + MV * kLanes <= lanes; m += MV * kLanes) block(std::integral_constant<int, AB>{}, std::integral_constant<int, MV>{}, a, m);
    for (; m < lanes; m += kLanes) block(std::integral_constant<int, AB>{}, std::integral_constant<int, 1>{}, a, m);
  }
  for (; a < rows_a; ++a)
    for (int64_t m = 0; m < lanes; m += kLanes) block(std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{}, a, m);
}

struct PrefillAttentionShape {
  int64_t nh, nkv, hd, block;
};

// Whether T's tiles run as bf16 pair dot products (Bf16PairMadd) rather than fp32 FMAs.
template <typename T>
constexpr bool kBf16Pairs =
#ifdef __AVX512BF16__
    std::is_same_v<T, bf16>;
#else
    false;
#endif

// One thread's scratch. fp32: q_t [hd, lanes] pre-scaled, acc_t [hd, lanes], scores [tile, lanes],
// keys and values [tile, hd]; per lane the running max and sum, the tile's max and correction, and
// its row's position (as a float: exact below 2^24, and compared in the lanes' vectors). bf16
// pairs (uint32): q [hd / 2, lanes], keys [tile, hd / 2] (rows as they lie), probabilities
// [tile / 2, lanes] and values [tile / 2, hd] with two keys' entries in each. first_key, last_key:
// per lane the keys it attends to.
struct PrefillScratch {
  std::vector<float> buffer;
  std::vector<uint32_t> pairs;
  float *q_t, *acc_t, *scores, *k, *v, *row_max, *row_sum, *correction, *tile_max, *first_key, *last_key;
  uint32_t *q_pairs, *k_pairs, *p_pairs, *v_pairs;

  PrefillScratch(int64_t lanes, int64_t hd)
      : buffer(lanes * (2 * hd + kPrefillKeyTile + 6) + 2 * kPrefillKeyTile * hd),
        pairs(hd / 2 * lanes + kPrefillKeyTile * hd / 2 + kPrefillKeyTile / 2 * (lanes + hd)) {
    q_t = buffer.data();
    acc_t = q_t + hd * lanes;
    scores = acc_t + hd * lanes;
    k = scores + kPrefillKeyTile * lanes;
    v = k + kPrefillKeyTile * hd;
    row_max = v + kPrefillKeyTile * hd;
    row_sum = row_max + lanes;
    correction = row_sum + lanes;
    tile_max = correction + lanes;
    first_key = tile_max + lanes;
    last_key = first_key + lanes;
    q_pairs = pairs.data();
    k_pairs = q_pairs + hd / 2 * lanes;
    p_pairs = k_pairs + kPrefillKeyTile * hd / 2;
    v_pairs = p_pairs + kPrefillKeyTile / 2 * lanes;
  }
};

// The online softmax's step over one tile's scores [tile_rows, lanes], in place into
// probabilities: the running max and sum move on, correction gets the factor that rescales the
// lanes' accumulated output. masked: some lane does not attend to some key of the tile, so keys
// outside [first_key, last_key] are masked (probability 0).
inline void softmax_tile(PrefillScratch& w, int64_t key0, int64_t tile_rows, int64_t lanes, bool masked) {
  float* __restrict__ row_max = w.row_max;
  float* __restrict__ row_sum = w.row_sum;
  float* __restrict__ correction = w.correction;
  const float* __restrict__ first_key = w.first_key;
  const float* __restrict__ last_key = w.last_key;
  float* __restrict__ tile_max = w.tile_max;
  for (int64_t m = 0; m < lanes; ++m) tile_max[m] = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < tile_rows; ++j) {
    const float* __restrict__ sj = w.scores + j * lanes;
    const float key = float(key0 + j);
#pragma omp simd
    for (int64_t m = 0; m < lanes; ++m)
      tile_max[m] = (!masked || (key >= first_key[m] && key <= last_key[m])) ? std::max(tile_max[m], sj[m])
                                                                             : tile_max[m];
  }
#pragma omp simd
  for (int64_t m = 0; m < lanes; ++m) {
    // the first tile holds every lane's first key (a lane's window starts at most 15 keys after the
    // item's first row's): row_max is finite after it
    const float new_max = std::max(row_max[m], tile_max[m]);
    correction[m] = exp_nonpositive(row_max[m] - new_max);   // -inf on the first tile: ~1e-38 x 0
    row_max[m] = new_max;
    row_sum[m] *= correction[m];
  }
  for (int64_t j = 0; j < tile_rows; ++j) {
    float* __restrict__ sj = w.scores + j * lanes;
    const float key = float(key0 + j);
#pragma omp simd
    for (int64_t m = 0; m < lanes; ++m) {
      const float p = (!masked || (key >= first_key[m] && key <= last_key[m])) ? exp_nonpositive(sj[m] - row_max[m])
                                                                                : 0.0f;
      sj[m] = p;
      row_sum[m] += p;
    }
  }
}

// One item: query rows [t0, t0 + rows) of a chunk (q, out at its first row) whose first row sits
// at position first_pos, the group of query heads of kv_head. Lane m is row m / group, head
// m % group; lanes past rows * group (padding to a multiple of 16) have zero queries, their
// results are dropped. window > 0: a sliding window; softcap > 0: capped scores.
template <typename T>
void prefill_item(T* out, int64_t out_s0, int64_t out_s1, const T* q, int64_t q_s0, int64_t q_s1,
                  const T* k_cache, const T* v_cache, int64_t page_stride, int64_t slot_stride,
                  const int64_t* table, int64_t first_pos, int64_t t0, int64_t rows, int64_t kv_head,
                  const PrefillAttentionShape& s, float scale, int64_t window, float softcap, PrefillScratch& w) {
  const int64_t group = s.nh / s.nkv, hd = s.hd, tile = kPrefillKeyTile;
  const int64_t used = rows * group, lanes = (used + kLanes - 1) / kLanes * kLanes;
  const int64_t keys = first_pos + t0 + rows;          // the item attends to keys [key_begin, keys)
  // a row at position p sees keys [window_start(p), p]
  auto window_start = [&](int64_t p) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; };
  const int64_t key_begin = window_start(first_pos + t0), last_row_begin = window_start(keys - 1);
  // a type that depends on T: the branches that kBf16Pairs discards are then never checked, so CPUs
  // without AVX512-BF16 (where Bf16PairMadd is only declared) compile them
  using PairMadd = std::conditional_t<kBf16Pairs<T>, Bf16PairMadd, Fp32Madd>;
  for (int64_t m = 0; m < lanes; ++m) {
    const T* src = q + (t0 + m / group) * q_s0 + (kv_head * group + m % group) * q_s1;
    if constexpr (kBf16Pairs<T>) {    // unscaled (bf16 exactly); the scores are scaled in fp32
      for (int64_t d = 0; d < hd; d += 2)
        w.q_pairs[d / 2 * lanes + m] = m < used ? uint32_t(src[d].x) | uint32_t(src[d + 1].x) << 16 : 0u;
    } else {
      for (int64_t d = 0; d < hd; ++d) w.q_t[d * lanes + m] = m < used ? to_float(src[d]) * scale : 0.0f;
    }
    w.last_key[m] = float(m < used ? first_pos + t0 + m / group : keys - 1);
    w.first_key[m] = float(m < used ? window_start(first_pos + t0 + m / group) : key_begin);
    w.row_max[m] = -std::numeric_limits<float>::infinity();
    w.row_sum[m] = 0.0f;
  }
  std::fill(w.acc_t, w.acc_t + hd * lanes, 0.0f);
  for (int64_t key0 = key_begin; key0 < keys; key0 += tile) {
    const int64_t tile_rows = std::min(tile, keys - key0);
    for (int64_t j = 0; j < tile_rows; ++j) {
      const int64_t pos = key0 + j;
      const int64_t offset = table[pos / s.block] * page_stride + (pos % s.block) * slot_stride + kv_head * hd;
      const T* k = k_cache + offset;
      const T* v = v_cache + offset;
      if constexpr (kBf16Pairs<T>) {
        std::memcpy(w.k_pairs + j * hd / 2, k, hd * sizeof(T));
        // values of keys 2i and 2i + 1 as bf16 pairs: row i of v_pairs (an odd last key pairs with zeros)
        uint32_t* __restrict__ vp = w.v_pairs + j / 2 * hd;
        const uint16_t* vb = reinterpret_cast<const uint16_t*>(v);
        if (j % 2 == 0)
          for (int64_t d = 0; d < hd; ++d) vp[d] = vb[d];
        else
          for (int64_t d = 0; d < hd; ++d) vp[d] |= uint32_t(vb[d]) << 16;
      } else {
        for (int64_t d = 0; d < hd; ++d) w.k[j * hd + d] = to_float(k[d]);
        for (int64_t d = 0; d < hd; ++d) w.v[j * hd + d] = to_float(v[d]);
      }
    }
    // scores [tile_rows, lanes]
    if constexpr (kBf16Pairs<T>)
      gemm_lanes<PairMadd, false>(w.k_pairs, hd / 2, 1, w.q_pairs, w.scores, tile_rows, lanes, hd / 2, nullptr, scale);
    else
      gemm_lanes<Fp32Madd, false>(w.k, hd, 1, w.q_t, w.scores, tile_rows, lanes, hd, nullptr, 1.0f);
    if (softcap > 0.0f) soft_cap(w.scores, tile_rows * lanes, softcap);
    softmax_tile(w, key0, tile_rows, lanes,
                 key0 + tile_rows - 1 > first_pos + t0 || key0 < last_row_begin);
    if constexpr (kBf16Pairs<T>) {
      // probabilities of keys 2i and 2i + 1 as one bf16 pair per lane (an odd last key pairs with 0)
      const int64_t key_pairs = (tile_rows + 1) / 2;
      for (int64_t i = 0; i < key_pairs; ++i) {
        const float* p0 = w.scores + 2 * i * lanes;
        uint32_t* __restrict__ pp = w.p_pairs + i * lanes;
        const bool odd = 2 * i + 1 == tile_rows;
        for (int64_t m = 0; m < lanes; ++m)
          pp[m] = uint32_t(from_float<bf16>(p0[m]).x) | (odd ? 0u : uint32_t(from_float<bf16>(p0[lanes + m]).x) << 16);
      }
      gemm_lanes<PairMadd, true>(w.v_pairs, 1, hd, w.p_pairs, w.acc_t, hd, lanes, key_pairs, w.correction, 1.0f);
    } else {
      gemm_lanes<Fp32Madd, true>(w.v, 1, hd, w.scores, w.acc_t, hd, lanes, tile_rows, w.correction, 1.0f);
    }
  }
  for (int64_t m = 0; m < used; ++m) {
    T* o = out + (t0 + m / group) * out_s0 + (kv_head * group + m % group) * out_s1;
    const float inv = 1.0f / w.row_sum[m];
    for (int64_t d = 0; d < hd; ++d) o[d] = from_float<T>(w.acc_t[d * lanes + m] * inv);
  }
}

// out, q: [tokens, nh, hd] with row strides (*_s0, *_s1; hd contiguous); chunk i's query rows are
// [query_starts[i], query_starts[i + 1]) and its first one sits at position first_pos[i] of its
// sequence. k_cache, v_cache: one layer's K and V; row `slot` of page p starts at p * page_stride +
// slot * slot_stride and holds nkv * hd values. tables: [chunks, table_stride] page ids. window > 0:
// a sliding window; softcap > 0: soft-capped scores.
template <typename T>
void paged_prefill_attention(T* out, int64_t out_s0, int64_t out_s1, const T* q, int64_t q_s0, int64_t q_s1,
                             const T* k_cache, const T* v_cache, int64_t page_stride, int64_t slot_stride,
                             const int64_t* tables, int64_t table_stride, const int64_t* query_starts,
                             const int64_t* first_pos, int64_t chunks, const PrefillAttentionShape& s, float scale,
                             int64_t window, float softcap) {
  struct Item { int64_t chunk, t0, rows, kv_head; };
  std::vector<Item> items;
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t n = query_starts[i + 1] - query_starts[i];
    for (int64_t t0 = 0; t0 < n; t0 += kPrefillQueryBlock)
      for (int64_t h = 0; h < s.nkv; ++h) items.push_back({i, t0, std::min(kPrefillQueryBlock, n - t0), h});
  }
  const int64_t group = s.nh / s.nkv;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), int64_t(items.size()));
  if (threads == 0) return;
  // round robin over the threads: an item's cost grows with its rows' positions, and contiguous
  // ranges of items would give one thread all the late (long) ones
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    PrefillScratch w((kPrefillQueryBlock * group + kLanes - 1) / kLanes * kLanes, s.hd);
    for (int64_t thread = begin; thread < end; ++thread)
      for (int64_t n = thread; n < int64_t(items.size()); n += threads) {
        const Item& it = items[n];
        prefill_item<T>(out + query_starts[it.chunk] * out_s0, out_s0, out_s1, q + query_starts[it.chunk] * q_s0,
                        q_s0, q_s1, k_cache, v_cache, page_stride, slot_stride, tables + it.chunk * table_stride,
                        first_pos[it.chunk], it.t0, it.rows, it.kv_head, s, scale, window, softcap, w);
      }
  });
}

}  // namespace asyncserve
