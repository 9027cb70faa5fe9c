// bf16 projections y = x W^T for decode-sized batches, on CPUs with AVX512-BF16.
//
// A decode step multiplies a few rows by every weight once, so it is bound by streaming the
// weights from DRAM while doing 16 bf16 multiply-adds per weight pair per 16 rows. oneDNN's
// reordered GEMM does those one after the other: at 16 rows on a Zen 4 core pair it streams
// 13-15 GB/s (about the sum of the DRAM time and the arithmetic time), against 21 GB/s when the
// weight sits in L3. This kernel overlaps them by prefetching the weight panel kPrefetch lines
// ahead of the dot products (BENCHMARKS.md, "Box D, eleventh session").
//
// W is packed once (linear.py, NativeLinear) as [N/16][K/2][16][2]: for each block of 16 output
// columns, the K/2 pairs of consecutive k, each pair of one column in one 32-bit lane; a block's
// panel is contiguous, so one thread streams it front to back. x: [M, K] bf16 rows, K even, read
// as 32-bit pairs and broadcast to all lanes. Each tile (16 rows x one column block, or from
// kWideFromRows rows 8 rows x two) keeps 16 fp32 accumulators in registers over all of K
// (vdpbf16ps: a pair of products per lane), rounded to bf16 once at the end. Column blocks are
// split between the threads in contiguous ranges.
#pragma once

#include <algorithm>
#include <cstdint>

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

// 32 lines (2 KiB) ahead: what a DRAM miss takes to arrive at 16 rows' arithmetic per line (16,
// 32 and 64 measured; 32 and 64 even, 16 and none slower).
constexpr int kPrefetch = 32;

// Rows x Blocks column blocks: y[r][block b's cols] = x[r] . panel b, for `Rows` rows of x (stride
// ldx pairs); panels k_pairs apart; the last block keeps `last_cols` of its 16 columns.
template <int Rows, int Blocks>
inline void gemm_tile(const uint32_t* x, int64_t ldx, const __m512i* panels, int64_t k_pairs, uint16_t* y,
                      int64_t ldy, int last_cols) {
  __m512 acc[Rows][Blocks];
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_pairs; ++k) {
    __m512bh w[Blocks];
    for (int b = 0; b < Blocks; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(panels + b * k_pairs + k + kPrefetch), _MM_HINT_T0);
      w[b] = (__m512bh)_mm512_loadu_si512(panels + b * k_pairs + k);
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(int(x[r * ldx + k]));
      for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xr, w[b]);
    }
  }
  const __mmask16 last = last_cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << last_cols) - 1);
  for (int r = 0; r < Rows; ++r)   // round to nearest even, as torch does
    for (int b = 0; b < Blocks; ++b)
      _mm256_mask_storeu_epi16(y + r * ldy + b * 16, b + 1 == Blocks ? last : __mmask16(0xFFFF),
                               (__m256i)_mm512_cvtneps_pbh(acc[r][b]));
}

// All M rows against `Blocks` neighbouring column blocks, in tiles of 16 rows (one block) or 8 (two).
template <int Blocks>
inline void gemm_rows(const uint32_t* x, int64_t M, int64_t k_pairs, const __m512i* panels, uint16_t* y,
                      int64_t N, int last_cols) {
  constexpr int kTile = Blocks == 1 ? 16 : 8;
  for (int64_t m = 0; m < M; m += kTile) {
    const uint32_t* xr = x + m * k_pairs;
    uint16_t* yr = y + m * N;
    switch (std::min<int64_t>(kTile, M - m)) {
#define ASYNCSERVE_TILE(R)                                                                   \
  case R:                                                                                    \
    if constexpr (R <= kTile) gemm_tile<R, Blocks>(xr, k_pairs, panels, k_pairs, yr, N, last_cols); \
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
// products (at 64-256 rows 409-443 GFLOP/s against 387-399 for 16 x 1 and oneDNN's 349-416, Zen 4,
// 2 threads); below it 16 x 1, whose weight panel is read once per 16 rows.
constexpr int64_t kWideFromRows = 32;

// x: [M, K] (K = 2 * k_pairs, rows contiguous); packed: [blocks, k_pairs, 16] pairs; y: [M, N].
inline void packed_linear_bf16(const uint16_t* x, int64_t M, int64_t k_pairs, const uint16_t* packed,
                               int64_t blocks, uint16_t* y, int64_t N) {
  const auto* xp = reinterpret_cast<const uint32_t*>(x);
  const auto* w = reinterpret_cast<const __m512i*>(packed);
  const int per_unit = M >= kWideFromRows ? 2 : 1;           // column blocks a thread's unit of work takes
  const int64_t units = (blocks + per_unit - 1) / per_unit;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u * per_unit;
      const int64_t span = std::min<int64_t>(per_unit, blocks - b);
      const int last_cols = int(std::min<int64_t>(16, N - (b + span - 1) * 16));
      if (span == 2)
        gemm_rows<2>(xp, M, k_pairs, w + b * k_pairs, y + b * 16, N, last_cols);
      else
        gemm_rows<1>(xp, M, k_pairs, w + b * k_pairs, y + b * 16, N, last_cols);
    }
  });
}

#endif

}  // namespace asyncserve
