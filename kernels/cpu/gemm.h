// Projections y = x W^T for decode-sized batches over packed weights: bf16 on CPUs with AVX512-BF16,
// float32 on AVX2 CPUs without AVX-512 (packed_linear_fp32, at the end).
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
//
// Where the CPU has AMX (Sapphire Rapids and later) and K is a multiple of 32, the same packed
// panels feed tile multiply-adds instead: a panel's 16 k-pairs x 16 columns x 2 are exactly a B
// tile in AMX's pair layout, so the packing, NativeLinear and the native decoder stay as they are.
// On an Emerald Rapids core pair they ran a step's projections 0.9-2.1x as fast as the vdpbf16ps
// tiles at 1-8 rows (weights from DRAM either way) and 2-12x at 16-256, where those are bound by
// the core's dot-product rate (BENCHMARKS.md, "Box E").
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>

#include "common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ASYNCSERVE_BF16_GEMM 1
#else
#define ASYNCSERVE_BF16_GEMM 0
#endif

// fp32 projections on CPUs with AVX2 and FMA but no AVX-512 (where bf16 has no dot product, so float32
// is the activation type; AVX-512 CPUs keep oneDNN's fp32, not measured against this).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define ASYNCSERVE_FP32_GEMM 1
#else
#define ASYNCSERVE_FP32_GEMM 0
#endif

#if ASYNCSERVE_BF16_GEMM && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ASYNCSERVE_AMX_GEMM 1
#else
#define ASYNCSERVE_AMX_GEMM 0
#endif

namespace asyncserve {

constexpr bool kBf16Gemm = ASYNCSERVE_BF16_GEMM;
constexpr bool kFp32Gemm = ASYNCSERVE_FP32_GEMM;

// Whether the AMX tiles run where the build has them (see the top); off for benchmarks and tests
// of the vdpbf16ps tiles on such a CPU.
inline std::atomic<bool> amx_gemm_on{true};

#if !ASYNCSERVE_AMX_GEMM
inline bool amx_tiles_run(int64_t) { return false; }   // the build has no AMX tiles (defined with them below)
#endif

// One thread's share of the spans' cache lines, asked for into L2 one line per step of a tile's
// inner loop. Rows asked for in a burst (between column blocks) stall the core until they arrive,
// so the GEMM loses what the later kernel saves; one line per step keeps a few in flight beside
// the arithmetic. Only tiles of kSideStreamFromRows rows and more ask: there the dot products bound
// the GEMM (on a CPU without AMX) and the DRAM is otherwise idle meanwhile; below, the weight stream
// bounds it, and the lines would only compete with it (4 decodes a step on Zen 4: asking in every tile
// measured +0.08 ms a step, where the same pairing with nothing asked reads +0.05). The
// lines move on to L3 as the weight stream pushes them out of L2, and the later kernel finds them there.
constexpr int64_t kSideStreamFromRows = 8;

class SideStream {
 public:
  // lines [first, first + count) of the spans, counted over all of them in order
  SideStream(const std::vector<PrefetchSpan>* spans, int64_t first, int64_t count) : spans_(spans), left_(count) {
    if (!spans || count <= 0) {
      left_ = 0;
      return;
    }
    for (; span_ < int64_t(spans->size()); ++span_) {
      const int64_t lines = lines_of((*spans)[span_]);
      if (first < lines) break;
      first -= lines;
    }
    if (span_ == int64_t(spans->size())) left_ = 0;
    else start_span(first);
  }

  static int64_t total_lines(const std::vector<PrefetchSpan>* spans) {
    int64_t n = 0;
    if (spans)
      for (const PrefetchSpan& s : *spans) n += lines_of(s);
    return n;
  }

  // of `lines` in all, the share of parts [begin, end) out of `parts` equal ones
  static SideStream share(const std::vector<PrefetchSpan>* spans, int64_t lines, int64_t begin, int64_t end,
                          int64_t parts) {
    return SideStream(spans, lines * begin / parts, lines * end / parts - lines * begin / parts);
  }

  const char* line() const { return left_ > 0 ? line_ : nullptr; }

  inline void next() {
    if (left_ <= 0) return;
    __builtin_prefetch(line_, 0, 2);   // into L2 (prefetcht1)
    advance();
  }

  void advance() {
    line_ += 64;
    if (--left_ > 0 && line_ >= end_) {
      if (++span_ < int64_t(spans_->size())) start_span(0);
      else left_ = 0;
    }
  }

 private:
  static const char* aligned(const void* p) { return reinterpret_cast<const char*>(uintptr_t(p) & ~uintptr_t(63)); }
  static int64_t lines_of(const PrefetchSpan& s) {
    return s.bytes > 0 ? (static_cast<const char*>(s.data) + s.bytes - aligned(s.data) + 63) / 64 : 0;
  }
  void start_span(int64_t line) {
    const PrefetchSpan& s = (*spans_)[span_];
    line_ = aligned(s.data) + 64 * line;
    end_ = static_cast<const char*>(s.data) + s.bytes;
  }

  const std::vector<PrefetchSpan>* spans_ = nullptr;
  int64_t span_ = 0, left_ = 0;
  const char* line_ = nullptr;
  const char* end_ = nullptr;
};

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
                      int last_cols, SideStream& side) {
  __m512 acc[Rows][Blocks];
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_pairs; ++k) {
    if constexpr (Rows >= kSideStreamFromRows) side.next();
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
                      int64_t N, int last_cols, SideStream& side) {
  for (int64_t m = 0; m < M; m += kTile) {
    const uint32_t* xr = x + m * k_pairs;
    uint16_t* yr = y + m * N;
    switch (std::min<int64_t>(kTile, M - m)) {
#define ASYNCSERVE_TILE(R)                                                                   \
  case R:                                                                                    \
    if constexpr (R <= kTile) gemm_tile<R, Blocks, RowTile>(xr, panels, k_pairs, yr, N, last_cols, side); \
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

#if ASYNCSERVE_AMX_GEMM

// Whether packed_linear_bf16 runs the AMX tiles for this K (= 2 * k_pairs).
inline bool amx_tiles_run(int64_t k_pairs) {
  return k_pairs % 16 == 0 && amx_gemm_on.load(std::memory_order_relaxed) && amx_permitted();
}

// tmm0-3: C tiles (row tile i, column block j at 2 * i + j), tmm4-5: A (x's row tiles), tmm6-7: B
// (panels); each 16 rows of 64 bytes (16 fp32, or 16 pairs of bf16).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// y[rows][cols] of one unit: up to 2 row tiles of x (16 rows each, ldx elements apart, K = 2 *
// k_pairs, k_pairs a multiple of 16) against up to 2 neighbouring panels; c: [32][32] fp32 scratch.
template <int RowTiles, int Blocks>
inline void amx_unit(const uint16_t* x, int64_t ldx, const __m512i* panels, int64_t k_pairs, float* c) {
  _tile_zero(0);
  if constexpr (Blocks > 1) _tile_zero(1);
  if constexpr (RowTiles > 1) _tile_zero(2);
  if constexpr (RowTiles > 1 && Blocks > 1) _tile_zero(3);
  for (int64_t k = 0; k < k_pairs; k += 16) {
    _tile_loadd(4, x + 2 * k, 2 * ldx);
    if constexpr (RowTiles > 1) _tile_loadd(5, x + 16 * ldx + 2 * k, 2 * ldx);
    _tile_loadd(6, panels + k, 64);
    if constexpr (Blocks > 1) _tile_loadd(7, panels + k_pairs + k, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (Blocks > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RowTiles > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RowTiles > 1 && Blocks > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 32 * 4);
  if constexpr (Blocks > 1) _tile_stored(1, c + 16, 32 * 4);
  if constexpr (RowTiles > 1) _tile_stored(2, c + 16 * 32, 32 * 4);
  if constexpr (RowTiles > 1 && Blocks > 1) _tile_stored(3, c + 16 * 32 + 16, 32 * 4);
}

// x: [M, K] contiguous, M >= 1, k_pairs a multiple of 16; y: [M, N]. Work in units of 32 rows x 2
// column blocks, column pairs split between the threads and each thread's rows inner, so its
// panels stay in L2 while x's row tiles pass; x's last rows short of a unit are read from a copy
// padded with zeros to 16 or 32 rows (a tile always loads 16).
inline void packed_linear_amx(const uint16_t* x, int64_t M, int64_t k_pairs, const __m512i* w, int64_t blocks,
                              uint16_t* y, int64_t N) {
  const int64_t K = 2 * k_pairs, full = M / 32 * 32, tail = M - full;
  thread_local std::vector<uint16_t> padded;
  if (tail) {
    padded.assign((tail > 16 ? 32 : 16) * K, 0);
    std::copy(x + full * K, x + M * K, padded.begin());
  }
  const uint16_t* pad = padded.data();   // the calling thread's buffer, not the pool threads' own
  const int64_t units = (blocks + 1) / 2;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    const TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float c[32 * 32];
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = 2 * u, span = std::min<int64_t>(2, blocks - b);
      const __m512i* panels = w + b * k_pairs;
      const int last_cols = int(std::min<int64_t>(16, N - (b + span - 1) * 16));
      for (int64_t m = 0; m < M; m += 32) {
        const int64_t rows = std::min<int64_t>(32, M - m);
        const uint16_t* xr = m < full ? x + m * K : pad;
        if (rows > 16) {
          if (span == 2) amx_unit<2, 2>(xr, K, panels, k_pairs, c);
          else amx_unit<2, 1>(xr, K, panels, k_pairs, c);
        } else {
          if (span == 2) amx_unit<1, 2>(xr, K, panels, k_pairs, c);
          else amx_unit<1, 1>(xr, K, panels, k_pairs, c);
        }
        for (int64_t r = 0; r < rows; ++r)   // round to nearest even, as torch does
          for (int64_t j = 0; j < span; ++j)
            _mm256_mask_storeu_epi16(y + (m + r) * N + (b + j) * 16,
                                     j + 1 == span ? __mmask16(last_cols >= 16 ? 0xFFFF : (1u << last_cols) - 1)
                                                   : __mmask16(0xFFFF),
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + r * 32 + j * 16)));
      }
    }
    _tile_release();
  });
}

#endif

// x: [M, K] (K = 2 * k_pairs, rows contiguous); packed: [blocks, k_pairs, 16] pairs; y: [M, N]. side:
// spans to ask for meanwhile, split between the threads as the column blocks are; the AMX tiles
// leave them (not measured there: their GEMM is bound by the weight stream far sooner).
inline void packed_linear_bf16(const uint16_t* x, int64_t M, int64_t k_pairs, const uint16_t* packed,
                               int64_t blocks, uint16_t* y, int64_t N,
                               const std::vector<PrefetchSpan>* side = nullptr) {
  const auto* xp = reinterpret_cast<const uint32_t*>(x);
  const auto* w = reinterpret_cast<const __m512i*>(packed);
#if ASYNCSERVE_AMX_GEMM
  if (amx_tiles_run(k_pairs)) {
    packed_linear_amx(x, M, k_pairs, w, blocks, y, N);
    return;
  }
#endif
  const int64_t side_lines = SideStream::total_lines(side);
  if (M >= kWideFromRows) {
    const int64_t units = (blocks + 1) / 2;   // two column blocks per unit of work
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      SideStream stream = SideStream::share(side, side_lines, begin, end, units);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t b = u * 2, span = std::min<int64_t>(2, blocks - b);
        const int last_cols = int(std::min<int64_t>(16, N - (b + span - 1) * 16));
        if (span == 2)
          gemm_rows<2, 8, false>(xp, M, k_pairs, w + b * k_pairs, y + b * 16, N, last_cols, stream);
        else
          gemm_rows<1, 16, false>(xp, M, k_pairs, w + b * k_pairs, y + b * 16, N, last_cols, stream);
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
    SideStream stream = SideStream::share(side, side_lines, begin, end, blocks);
    for (int64_t b = begin; b < end; ++b)
      gemm_rows<1, 16, true>(xt, M, k_pairs, w + b * k_pairs, y + b * 16, N,
                             int(std::min<int64_t>(16, N - b * 16)), stream);
  });
}

#endif

#if ASYNCSERVE_FP32_GEMM

// The fp32 GEMM's W is packed as [N/16][K][16] (NativeLinear: one k's 16 columns per 64-byte line), so
// a column block's panel is one front-to-back stream. oneDNN's fp32 GEMM streams a decode step's
// weights at 6-7 GB/s at 16 rows on a Zen 3 core pair whose DRAM gives 22 (it runs the stream and the
// arithmetic one after the other); this overlaps them. Each thread walks its column blocks' panels in
// chunks of kFp32Chunk k; every row tile of a chunk asks for its share of the lines kFp32PrefetchL2
// ahead into L2 (asking only in the first tile left the DRAM idle while the others computed: 16 rows
// 15-30% slower), and the first also kFp32PrefetchL1 lines ahead into L1; the other tiles find the
// chunk in L1. A tile is up to 6 rows x 16 columns: 12 ymm accumulators, two weight vectors and one
// broadcast of x fill the 16 registers. x is copied once per call into 6-row tiles laid out [K][tile
// rows], so a tile's broadcasts of one k come through one pointer (6 row pointers cost the loop 2
// address operations per row). Partial sums of later chunks are added in y.
constexpr int64_t kFp32Chunk = 256;
constexpr int kFp32PrefetchL2 = 256, kFp32PrefetchL1 = 16;
constexpr int kFp32TileRows = 6;

// Where a chunk's row tiles are in asking for the lines ahead: each tile's k step asks for the line at
// `line` and moves it on by `step` bytes (64 / the chunk's tiles), so the chunk's tiles together ask
// for as many lines as the chunk has.
struct LinesAhead {
  const char* line;
  int64_t step;
};

// y[0:Rows][0:16] (+ y if !First) += x tile [kc][Rows] . panel [kc][16]; Streams: the chunk's first tile,
// which also asks for the lines ahead into L1, and for side's.
template <int Rows, bool First, bool Streams>
inline void fp32_tile(const float* x, const float* panel, int64_t kc, float* y, int64_t ldy, LinesAhead& ahead,
                      SideStream& side) {
  __m256 acc[Rows][2];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
    for (int h = 0; h < 2; ++h) acc[r][h] = First ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy + 8 * h);
  const char* far = ahead.line;
#pragma GCC unroll 2
  for (int64_t k = 0; k < kc; ++k) {
    const float* line = panel + k * 16;
    _mm_prefetch(far, _MM_HINT_T1);
    far += ahead.step;
    if constexpr (Streams) {
      side.next();
      _mm_prefetch(reinterpret_cast<const char*>(line + 16 * kFp32PrefetchL1), _MM_HINT_T0);
    }
    const __m256 w0 = _mm256_load_ps(line), w1 = _mm256_load_ps(line + 8);
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + k * Rows + r);
      acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
  ahead.line = far;
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + r * ldy + 8 * h, acc[r][h]);
}

template <bool First, bool Streams>
inline void fp32_tile_rows(int rows, const float* x, const float* panel, int64_t kc, float* y, int64_t ldy,
                           LinesAhead& ahead, SideStream& side) {
  switch (rows) {
    case 1: fp32_tile<1, First, Streams>(x, panel, kc, y, ldy, ahead, side); break;
    case 2: fp32_tile<2, First, Streams>(x, panel, kc, y, ldy, ahead, side); break;
    case 3: fp32_tile<3, First, Streams>(x, panel, kc, y, ldy, ahead, side); break;
    case 4: fp32_tile<4, First, Streams>(x, panel, kc, y, ldy, ahead, side); break;
    case 5: fp32_tile<5, First, Streams>(x, panel, kc, y, ldy, ahead, side); break;
    default: fp32_tile<kFp32TileRows, First, Streams>(x, panel, kc, y, ldy, ahead, side); break;
  }
}

// x: [M, K] rows contiguous; packed: [blocks, K, 16]; y: [M, N]. side: as packed_linear_bf16's.
inline void packed_linear_fp32(const float* x, int64_t M, int64_t K, const float* packed, int64_t blocks, float* y,
                               int64_t N, const std::vector<PrefetchSpan>* side = nullptr) {
  thread_local std::vector<float> tiles;   // x as row tiles, kept between calls
  tiles.resize(M * K);
  for (int64_t m = 0; m < M; m += kFp32TileRows) {
    const int64_t rows = std::min<int64_t>(kFp32TileRows, M - m);
    float* t = tiles.data() + m * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < rows; ++r) t[k * rows + r] = x[(m + r) * K + k];
  }
  const float* xt = tiles.data();   // the calling thread's buffer, not the pool threads' own
  const int64_t side_lines = SideStream::total_lines(side);
  const int64_t row_tiles = (M + kFp32TileRows - 1) / kFp32TileRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    SideStream stream = SideStream::share(side, side_lines, begin, end, blocks);
    SideStream none(nullptr, 0, 0);
    SideStream& first_tile = M >= kSideStreamFromRows ? stream : none;
    thread_local std::vector<float> last;   // the last block's 16 columns, where N is not a multiple of 16
    for (int64_t b = begin; b < end; ++b) {
      const int64_t cols = std::min<int64_t>(16, N - b * 16);
      float* yb = y + b * 16;
      int64_t ldy = N;
      if (cols < 16) {
        last.resize(M * 16);
        yb = last.data();
        ldy = 16;
      }
      const float* panel = packed + b * K * 16;
      for (int64_t k0 = 0; k0 < K; k0 += kFp32Chunk) {
        const int64_t kc = std::min(kFp32Chunk, K - k0);
        LinesAhead ahead{reinterpret_cast<const char*>(panel + (k0 + kFp32PrefetchL2) * 16), 64 / row_tiles};
        for (int64_t m = 0; m < M; m += kFp32TileRows) {
          const int rows = int(std::min<int64_t>(kFp32TileRows, M - m));
          const float* xr = xt + m * K + k0 * rows;
          const float* chunk = panel + k0 * 16;
          float* yr = yb + m * ldy;
          if (k0 == 0 && m == 0) fp32_tile_rows<true, true>(rows, xr, chunk, kc, yr, ldy, ahead, first_tile);
          else if (k0 == 0) fp32_tile_rows<true, false>(rows, xr, chunk, kc, yr, ldy, ahead, first_tile);
          else if (m == 0) fp32_tile_rows<false, true>(rows, xr, chunk, kc, yr, ldy, ahead, first_tile);
          else fp32_tile_rows<false, false>(rows, xr, chunk, kc, yr, ldy, ahead, first_tile);
        }
      }
      if (cols < 16)
        for (int64_t r = 0; r < M; ++r) std::copy(yb + r * 16, yb + r * 16 + cols, y + r * N + b * 16);
    }
  });
}

#endif

}  // namespace asyncserve
