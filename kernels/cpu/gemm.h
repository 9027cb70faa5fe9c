// bf16 projections y = x W^T for decode-sized batches, on CPUs with AVX512-BF16.
//
// A decode step multiplies a few rows by every weight once, so it is bound by streaming the
// weights from DRAM while doing 16 bf16 multiply-adds per weight pair per 16 rows. oneDNN's
// reordered GEMM does those one after the other: at 16 rows on a Zen 4 core pair it streams
// 13-15 GB/s (about the sum of the DRAM time and the arithmetic time), against 21 GB/s when the
// weight sits in L3. This kernel overlaps them by asking for the weight panel twice ahead of the
// dot products: kPrefetchL2 lines ahead into L2, which keeps enough DRAM reads in flight, and
// kPrefetch lines ahead into L1 (BENCHMARKS.md, "Box D, eleventh session" and "fourteenth").
//
// W is packed once (linear.py, NativeLinear) as [N/16][K/2][16][2]: for each block of 16 output
// columns, the K/2 pairs of consecutive k, each pair of one column in one 32-bit lane; a block's
// panel is contiguous, so one thread streams it front to back. x: [M, K] bf16 rows, K even; below
// kWideFromRows rows it is copied once per call into 16-row tiles laid out [K/2][tile rows]
// (32-bit pairs), so a tile's broadcasts of one k-pair read one line through one pointer (16 row
// pointers left too few registers: the loop spilled them). Each tile (16 rows x one column block,
// or from kWideFromRows rows 8 rows x two) keeps 16 fp32 accumulators in registers over all of K
// (vdpbf16ps: a pair of products per lane), rounded to bf16 once at the end. Column blocks are
// split between the threads in contiguous ranges.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ASYNCSERVE_BF16_GEMM 1
#else
#define ASYNCSERVE_BF16_GEMM 0
#endif

namespace asyncserve {

constexpr bool kBf16Gemm = ASYNCSERVE_BF16_GEMM;

#if ASYNCSERVE_BF16_GEMM

// Into L1 32 lines (2 KiB) ahead: what an L2 hit takes to arrive at 16 rows' arithmetic per line
// (16, 32 and 64 measured). Into L2 256 lines (16 KiB) ahead, from kPrefetchL2FromRows rows: at 16
// rows a step's GEMMs took 12.5 ms without and 10.8 with it (128-512 lines alike); at 1-4 rows,
// bound by the DRAM stream alone, the hardware prefetcher does as well and the extra requests cost.
constexpr int kPrefetch = 32;
constexpr int kPrefetchL2 = 256;
constexpr int kPrefetchL2FromRows = 8;

// Rows x Blocks column blocks: y[r][block b's cols] = x[r] . panel b, for `Rows` rows of x, which
// are [k_pairs][Rows] if RowTile, else [Rows][k_pairs]; panels k_pairs apart; the last block keeps
// `last_cols` of its 16 columns.
template <int Rows, int Blocks, bool RowTile>
inline void gemm_tile(const uint32_t* x, const __m512i* panels, int64_t k_pairs, uint16_t* y, int64_t ldy,
                      int last_cols) {
  __m512 acc[Rows][Blocks];
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_pairs; ++k) {
    __m512bh w[Blocks];
    for (int b = 0; b < Blocks; ++b) {
      const __m512i* line = panels + b * k_pairs + k;
      if constexpr (RowTile && Rows >= kPrefetchL2FromRows)
        _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchL2), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetch), _MM_HINT_T0);
      w[b] = (__m512bh)_mm512_loadu_si512(line);
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(int(RowTile ? x[k * Rows + r] : x[r * k_pairs + k]));
      for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xr, w[b]);
    }
  }
  const __mmask16 last = last_cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << last_cols) - 1);
  for (int r = 0; r < Rows; ++r)   // round to nearest even, as torch does
    for (int b = 0; b < Blocks; ++b)
      _mm256_mask_storeu_epi16(y + r * ldy + b * 16, b + 1 == Blocks ? last : __mmask16(0xFFFF),
                               (__m256i)_mm512_cvtneps_pbh(acc[r][b]));
}

// All M rows against `Blocks` neighbouring column blocks, in tiles of kTile rows; x: [M][k_pairs],
// or if RowTile its tiles one after the other, each [k_pairs][its rows].
template <int Blocks, int kTile, bool RowTile>
inline void gemm_rows(const uint32_t* x, int64_t M, int64_t k_pairs, const __m512i* panels, uint16_t* y,
                      int64_t N, int last_cols) {
  for (int64_t m = 0; m < M; m += kTile) {
    const uint32_t* xr = x + m * k_pairs;
    uint16_t* yr = y + m * N;
    switch (std::min<int64_t>(kTile, M - m)) {
#define ASYNCSERVE_TILE(R)                                                                   \
  case R:                                                                                    \
    if constexpr (R <= kTile) gemm_tile<R, Blocks, RowTile>(xr, panels, k_pairs, yr, N, last_cols); \
    break;
      ASYNCSERVE_TILE(1) ASYNCSERVE_TILE(2) ASYNCSERVE_TILE(3) ASYNCSERVE_TILE(4)
      ASYNCSERVE_TILE(5) ASYNCSERVE_TILE(6) ASYNCSERVE_TILE(7) ASYNCSERVE_TILE(8)
      ASYNCSERVE_TILE(9) ASYNCSERVE_TILE(10) ASYNCSERVE_TILE(11) ASYNCSERVE_TILE(12)
      ASYNCSERVE_TILE(13) ASYNCSERVE_TILE(14) ASYNCSERVE_TILE(15) ASYNCSERVE_TILE(16)
#undef ASYNCSERVE_TILE
    }
  }
}

// From this many rows on, tiles of 8 rows x 2 column blocks: each broadcast of x feeds two dot
// products, and x is read where it is. Below it 16 x 1, whose weight panel is read once per 16
// rows, with x copied as row tiles and the panel asked for in L2 as well: a step's GEMMs at 12 / 16
// / 32 / 64 / 80 rows 25 / 13 / 7 / 2 / 1 % faster than the wide tiles or the 16 x 1 tiles before
// (Zen 4, 2 threads); at 96 rows and more the wide tiles win (at 128, 2 %).
constexpr int64_t kWideFromRows = 96;

// x: [M, K] (K = 2 * k_pairs, rows contiguous); packed: [blocks, k_pairs, 16] pairs; y: [M, N].
inline void packed_linear_bf16(const uint16_t* x, int64_t M, int64_t k_pairs, const uint16_t* packed,
                               int64_t blocks, uint16_t* y, int64_t N) {
  const auto* xp = reinterpret_cast<const uint32_t*>(x);
  const auto* w = reinterpret_cast<const __m512i*>(packed);
  if (M >= kWideFromRows) {
    const int64_t units = (blocks + 1) / 2;   // two column blocks per unit of work
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const int64_t b = u * 2, span = std::min<int64_t>(2, blocks - b);
        const int last_cols = int(std::min<int64_t>(16, N - (b + span - 1) * 16));
        if (span == 2)
          gemm_rows<2, 8, false>(xp, M, k_pairs, w + b * k_pairs, y + b * 16, N, last_cols);
        else
          gemm_rows<1, 16, false>(xp, M, k_pairs, w + b * k_pairs, y + b * 16, N, last_cols);
      }
    });
    return;
  }
  thread_local std::vector<uint32_t> tiles;   // x as row tiles (see the top), kept between calls
  tiles.resize(M * k_pairs);
  for (int64_t m = 0; m < M; m += 16) {
    const int64_t rows = std::min<int64_t>(16, M - m);
    uint32_t* t = tiles.data() + m * k_pairs;
    // k outer, so the tile is written front to back (row by row, the 48 KB tile of a 1,536-wide x
    // was swept 16 times, out of L1)
    for (int64_t k = 0; k < k_pairs; ++k)
      for (int64_t r = 0; r < rows; ++r) t[k * rows + r] = xp[(m + r) * k_pairs + k];
  }
  const uint32_t* xt = tiles.data();   // the calling thread's buffer, not the pool threads' own
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      gemm_rows<1, 16, true>(xt, M, k_pairs, w + b * k_pairs, y + b * 16, N,
                             int(std::min<int64_t>(16, N - b * 16)));
  });
}

#endif

}  // namespace asyncserve
