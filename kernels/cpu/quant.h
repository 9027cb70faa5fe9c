// Projections y = x W^T over weights kept in GGUF's own block formats (Q4_0, Q4_1, Q8_0, Q4_K,
// Q5_K, Q6_K), the bits exactly as the file stores them, one row of blocks per output column.
//
// As llama.cpp does, the activations are quantized once per call to int8 in blocks of 32 (one
// fp32 scale each, |q| <= 127) and the dot products run in integers: every format decodes to
// unsigned (or, for Q8_0, signed) bytes q with, per group of 16 weights, a scale s and an offset m
// such that w = s q + m exactly (for the K-quants s = d * sc and m = -dmin * mn, products of an
// fp16 and a 6-bit integer, exact in fp32; Q4_0's m = -8 d, Q6_K's m = -32 d sc). Then
//     sum_i w_i x_i ~= sum_chunks dx (s . dot(q, qx)) + sum_groups m (dx sum(qx)),
// the second sum over per-16 sums of the activations computed with their quantization.
//
// Work is split between the threads by output columns in contiguous ranges. A thread decodes one
// column (all of K) into bytes and per-16 scales once, into buffers that stay in L1/L2, then runs
// every row of x over it in tiles of kQuantTile rows whose fp32 accumulators stay in registers:
// the decoding is paid once per column, not once per row. The integer dot products are AVX2's
// vpmaddubsw + vpmaddwd, or one vpdpbusd where the CPU has AVX512-VNNI (+VL) or AVX-VNNI; a scalar
// loop runs where the build has no AVX2. From quant_panel_rows rows (a prefill's) an AVX2 build runs a
// GEMM over panels of 8 columns instead (see "Many rows" below): the per-column tiles there cost a float
// conversion, two multiplies and a broadcast per 32 products of each row. Q4_0, Q4_1, Q4_K, Q5_K and Q6_K
// repacked at load into such panels (kQ4_K_Panels .., below) run their tiles at every row count; Q4_K, Q5_K
// and Q6_K panels on AMX's int8 tiles instead where the CPU has them, from quant_amx_rows rows (quant_amx.h).
//
// Q4_K and Q5_K run as llama.cpp's ggml_vec_dot_q4_K_q8_K does: their activations quantized per
// super-block of 256 instead (one scale each, as its q8_K), so that the 8 chunks' integer dot products,
// each times its 6-bit scale (vpmaddwd by the scale where the others multiply by ones), add up in int32
// and fold to float once per super-block, the mins likewise from the activations' per-32 sums.
//
// The other strategy, for comparison (set_quant_int8(false), scripts/bench_quant.py): the column
// dequantized to fp32 once and the rows' fp32 activations multiplied with FMAs, exact activations.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ASYNCSERVE_QUANT_AVX2 1
#else
#define ASYNCSERVE_QUANT_AVX2 0
#endif

#if ASYNCSERVE_QUANT_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ASYNCSERVE_QUANT_VNNI 1   // vpdpbusd on ymm registers (EVEX)
#elif ASYNCSERVE_QUANT_AVX2 && defined(__AVXVNNI__)
#define ASYNCSERVE_QUANT_VNNI 2   // vpdpbusd on ymm registers (VEX)
#else
#define ASYNCSERVE_QUANT_VNNI 0
#endif

namespace asyncserve {

// ggml's type ids (GGMLQuantizationType)
enum QuantType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct QuantFormat {
  int64_t block;   // weights per block
  int64_t bytes;   // bytes per block
};

// The formats this file runs, by ggml type id (gguf's GGML_QUANT_SIZES); block 0 for others.
constexpr QuantFormat quant_format(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

// Not a ggml type: Q4_K's blocks repacked into panels of 8 columns (repack_panels), the same bits in an
// order that a tile decodes with one load, one shift and two ands per 8 weights of 8 columns: quant_linear
// runs it at any row count where this build runs panels (q4k_panel_tile), with no panel built per call.
// Per panel (8 columns, the weight's out % 8 == 0) and super-block of 256, kQ4KPanelBytes bytes:
//   [0, 1024)     32 vectors of 32 bytes; vector 4j + p (chunk j of 32, pair p of steps of 4): byte 4n + i
//                 holds column n's weight 32j + 8p + i in its low nibble, 32j + 8p + 4 + i in its high one
//   [1024, 1088)  the chunks' 6-bit scales, [j][n]
//   [1088, 1152)  their 6-bit mins, [i][n][2]: chunks 2i and 2i + 1 (an int16 pair per column, widened)
//   [1152, 1184)  d, then dmin, of the 8 columns (fp16)
// Q5_K as Q4_K (the weights' low 4 bits in its nibbles), kQ5KPanelBytes, and their fifth bits after:
//   [1184, 1440)  8 vectors of 32 bytes; vector j (chunk j): byte 4n + i holds in bit five_bit(p, 0) the fifth
//                 bit of column n's weight 32j + 8p + i, in bit five_bit(p, 1) that of 32j + 8p + 4 + i
// Q6_K likewise (repack_panels, q6k_panel_tile), kQ6KPanelBytes per 8 columns and 256 weights, as many
// bytes as its blocks:
//   [0, 1024)     the weights' low 4 bits, as Q4_K's nibbles above
//   [1024, 1536)  their high 2 bits: vector 2j + h (chunk j, pairs 2h and 2h + 1): byte 4n + i holds, from
//                 bit 0 up in 2-bit fields, column n's weights 32j + 16h + i, + 4, + 8 and + 12
//   [1536, 1664)  the 16 groups' int8 scales, [j][n][2]: groups 2j and 2j + 1 (an int16 pair per column)
//   [1664, 1680)  d of the 8 columns (fp16)
// Q4_0 and Q4_1 likewise per block of 32 weights (block32_column, block32_panel_tile), as many bytes as
// their blocks:
//   [0, 128)      4 vectors of 32 bytes: vector p, byte 4n + i holds column n's weight 8p + i in its low
//                 nibble, 8p + 4 + i in its high one (Q4_K's nibbles, one chunk)
//   [128, 144)    d of the 8 columns (fp16); Q4_1: [144, 160) their m (fp16)
constexpr int64_t kQ4_0_Panels = 0x100 + kQ4_0, kQ4_1_Panels = 0x100 + kQ4_1;   // the ggml type + 0x100
constexpr int64_t kQ4_K_Panels = 0x100 + kQ4_K, kQ5_K_Panels = 0x100 + kQ5_K, kQ6_K_Panels = 0x100 + kQ6_K;
constexpr int64_t kQ4KPanelBytes = 1184, kQ5KPanelBytes = 1440, kQ6KPanelBytes = 1680;

// Where Q5_K's panels keep the fifth bit of pair p's low (high = 0) or high nibbles' weights: pairs 0 and 1
// in bits 4-7, 2 and 3 in bits 0-3, so that a tile reads pairs 0-1 at bit 4 with right shifts and pairs 2-3
// after one left shift by 4 (16-bit shifts: no bit crosses into the other byte's bit 4).
constexpr int five_bit(int p, int high) { return (2 * p + 4) % 8 + high; }

// The blocks quant_linear and quant_rows take for a part of `type`: a ggml type's, or a panel type's (a
// column's share of its panels per block of the ggml type).
constexpr QuantFormat part_format(int64_t type) {
  return type == kQ4_K_Panels   ? QuantFormat{256, kQ4KPanelBytes / 8}
         : type == kQ5_K_Panels ? QuantFormat{256, kQ5KPanelBytes / 8}
         : type == kQ6_K_Panels ? QuantFormat{256, kQ6KPanelBytes / 8}
         : type == kQ4_0_Panels || type == kQ4_1_Panels ? quant_format(type - 0x100)
                                : quant_format(type);
}

constexpr bool panel_type(int64_t type) {
  return type == kQ4_0_Panels || type == kQ4_1_Panels || type == kQ4_K_Panels || type == kQ5_K_Panels ||
         type == kQ6_K_Panels;
}

// The ggml types repack_panels takes.
constexpr bool has_panels(int64_t type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ4_K || type == kQ5_K || type == kQ6_K;
}

// The bytes of a panel (8 columns) per block of a panel type.
constexpr int64_t panel_block_bytes(int64_t type) { return part_format(type).bytes * 8; }

// Q4_K and Q5_K's 6-bit scales and mins of the 8 chunks of 32 (gguf's Q4_K.get_scale_min).
inline void k_scales(const uint8_t* s, int sc[8], int mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[4 + j] & 0x3F;
    sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
  }
}

// Column col's 32 * chunks values q of one panel's block (src), 4-bit (Q4_0, Q4_1: 1 chunk; Q4_K: 8) or, with
// `high` (Q6_K's high bit pairs), Q6_K's 6-bit ones: the values gguf's blocks hold, in order.
inline void panel_values(const uint8_t* src, int col, int chunks, bool high, uint8_t* q) {
  for (int j = 0; j < chunks; ++j)
    for (int p = 0; p < 4; ++p)
      for (int i = 0; i < 4; ++i) {
        const uint8_t low = src[32 * (4 * j + p) + 4 * col + i];
        const uint8_t bits = high ? src[1024 + 32 * (2 * j + p / 2) + 4 * col + i] >> (4 * (p % 2)) : 0;
        q[32 * j + 8 * p + i] = uint8_t((low & 0x0F) | (bits & 3) << 4);
        q[32 * j + 8 * p + 4 + i] = uint8_t((low >> 4) | ((bits >> 2) & 3) << 4);
      }
}

// One Q6_K block's 256 weights as 6-bit values q (w = d sc[i / 16] (q - 32)): gguf's Q6_K layout.
inline void q6k_values(const uint8_t* block, uint8_t q[256]) {
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = block + 64 * h;
    const uint8_t* qh = block + 128 + 32 * h;
    for (int l = 0; l < 32; ++l) {
      q[128 * h + l] = uint8_t((ql[l] & 0x0F) | ((qh[l] & 3) << 4));
      q[128 * h + l + 32] = uint8_t((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
      q[128 * h + l + 64] = uint8_t((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
      q[128 * h + l + 96] = uint8_t((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
    }
  }
}

// panel_values undone for column col: q's low 4 bits into the nibbles and, with `high`, its high bit pairs.
inline void put_panel_values(const uint8_t* q, int col, int chunks, bool high, uint8_t* dst) {
  for (int j = 0; j < chunks; ++j)
    for (int p = 0; p < 4; ++p)
      for (int i = 0; i < 4; ++i)
        dst[32 * (4 * j + p) + 4 * col + i] = uint8_t((q[32 * j + 8 * p + i] & 0x0F) | (q[32 * j + 8 * p + 4 + i] & 0x0F) << 4);
  if (high)
    for (int j = 0; j < 8; ++j)
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i) {
          const uint8_t* w = q + 32 * j + 16 * h + i;
          dst[1024 + 32 * (2 * j + h) + 4 * col + i] = uint8_t((w[0] >> 4) | (w[4] >> 4) << 2 | (w[8] >> 4) << 4 | (w[12] >> 4) << 6);
        }
}

// One Q4_K or Q5_K block (column col of a panel's super-block at dst) into the panel, or back (to_panel
// false). Q5_K's fifth bits: bit c of its qh byte i is that of chunk c's weight i.
inline void kquant_column(int64_t type, uint8_t* block, uint8_t* dst, int col, bool to_panel) {
  const bool five = type == kQ5_K;
  uint8_t* qs = block + (five ? 48 : 16);
  uint8_t* qh = block + 16;
  uint8_t* high = dst + kQ4KPanelBytes;
  uint8_t q[256];   // chunk c's weights at 32c.. (the block's 128 bytes: chunk 2j low nibbles, 2j + 1 high)
  if (to_panel) {
    int sc[8], mn[8];
    k_scales(block + 4, sc, mn);
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 32; ++i) {
        q[64 * j + i] = qs[32 * j + i] & 0x0F;
        q[64 * j + 32 + i] = qs[32 * j + i] >> 4;
      }
    put_panel_values(q, col, 8, false, dst);
    if (five)
      for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 4; ++i) {
          uint8_t bits = 0;
          for (int p = 0; p < 4; ++p)
            bits |= uint8_t(((qh[8 * p + i] >> j) & 1) << five_bit(p, 0) | ((qh[8 * p + 4 + i] >> j) & 1) << five_bit(p, 1));
          high[32 * j + 4 * col + i] = bits;
        }
    for (int j = 0; j < 8; ++j) dst[1024 + 8 * j + col] = uint8_t(sc[j]);
    for (int j = 0; j < 8; ++j) dst[1088 + 16 * (j / 2) + 2 * col + j % 2] = uint8_t(mn[j]);
    std::memcpy(dst + 1152 + 2 * col, block, 2);
    std::memcpy(dst + 1168 + 2 * col, block + 2, 2);
    return;
  }
  int sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = dst[1024 + 8 * j + col];
    mn[j] = dst[1088 + 16 * (j / 2) + 2 * col + j % 2];
  }
  std::memcpy(block, dst + 1152 + 2 * col, 2);
  std::memcpy(block + 2, dst + 1168 + 2 * col, 2);
  for (int j = 0; j < 4; ++j) {   // k_scales' inverse
    block[4 + j] = uint8_t(sc[j] | ((sc[4 + j] >> 4) << 6));
    block[8 + j] = uint8_t(mn[j] | ((mn[4 + j] >> 4) << 6));
    block[12 + j] = uint8_t((sc[4 + j] & 0x0F) | ((mn[4 + j] & 0x0F) << 4));
  }
  panel_values(dst, col, 8, false, q);
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 32; ++i) qs[32 * j + i] = uint8_t(q[64 * j + i] | (q[64 * j + 32 + i] << 4));
  if (five) {
    std::memset(qh, 0, 32);
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 4; ++i)
        for (int p = 0; p < 4; ++p) {
          const uint8_t bits = high[32 * j + 4 * col + i];
          qh[8 * p + i] |= uint8_t(((bits >> five_bit(p, 0)) & 1) << j);
          qh[8 * p + 4 + i] |= uint8_t(((bits >> five_bit(p, 1)) & 1) << j);
        }
  }
}

// One Q6_K block likewise.
inline void q6k_column(uint8_t* block, uint8_t* dst, int col, bool to_panel) {
  uint8_t q[256];
  if (to_panel) {
    q6k_values(block, q);
    put_panel_values(q, col, 8, true, dst);
    for (int g = 0; g < 16; ++g) dst[1536 + 16 * (g / 2) + 2 * col + g % 2] = block[192 + g];
    std::memcpy(dst + 1664 + 2 * col, block + 208, 2);
    return;
  }
  panel_values(dst, col, 8, true, q);
  for (int h = 0; h < 2; ++h)   // q6k_values' inverse
    for (int l = 0; l < 32; ++l) {
      const uint8_t* w = q + 128 * h + l;
      block[64 * h + l] = uint8_t((w[0] & 0x0F) | (w[64] & 0x0F) << 4);
      block[64 * h + l + 32] = uint8_t((w[32] & 0x0F) | (w[96] & 0x0F) << 4);
      block[128 + 32 * h + l] = uint8_t((w[0] >> 4) | (w[32] >> 4) << 2 | (w[64] >> 4) << 4 | (w[96] >> 4) << 6);
    }
  for (int g = 0; g < 16; ++g) block[192 + g] = dst[1536 + 16 * (g / 2) + 2 * col + g % 2];
  std::memcpy(block + 208, dst + 1664 + 2 * col, 2);
}

// One Q4_0 or Q4_1 block (weight i in byte i's low nibble, i + 16 in its high one, after d and Q4_1's m)
// likewise.
inline void block32_column(int64_t type, uint8_t* block, uint8_t* dst, int col, bool to_panel) {
  const int head = type == kQ4_1 ? 4 : 2;   // the fp16 d (and m) before the nibbles
  uint8_t q[32];
  if (to_panel) {
    for (int i = 0; i < 16; ++i) {
      q[i] = block[head + i] & 0x0F;
      q[i + 16] = block[head + i] >> 4;
    }
    put_panel_values(q, col, 1, false, dst);
    std::memcpy(dst + 128 + 2 * col, block, 2);
    if (type == kQ4_1) std::memcpy(dst + 144 + 2 * col, block + 2, 2);
    return;
  }
  panel_values(dst, col, 1, false, q);
  for (int i = 0; i < 16; ++i) block[head + i] = uint8_t(q[i] | q[i + 16] << 4);
  std::memcpy(block, dst + 128 + 2 * col, 2);
  if (type == kQ4_1) std::memcpy(block + 2, dst + 144 + 2 * col, 2);
}

// blocks [N][K/block * bytes] of a type with panels (has_panels; N % 8 == 0) <-> panels [N/8][K/block][panel
// bytes], the way to_panel says; every block is one column of one panel's block.
inline void repack_panels(int64_t type, uint8_t* blocks, int64_t N, int64_t K, uint8_t* panels, bool to_panel) {
  const QuantFormat f = quant_format(type);
  const int64_t count = K / f.block, panel_bytes = panel_block_bytes(0x100 + type);
  at::parallel_for(0, N / 8, 16, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel)
      for (int64_t s = 0; s < count; ++s)
        for (int n = 0; n < 8; ++n) {
          uint8_t* block = blocks + ((8 * panel + n) * count + s) * f.bytes;
          uint8_t* dst = panels + (panel * count + s) * panel_bytes;
          if (type == kQ4_K || type == kQ5_K) kquant_column(type, block, dst, n, to_panel);
          else if (type == kQ6_K) q6k_column(block, dst, n, to_panel);
          else block32_column(type, block, dst, n, to_panel);
        }
  });
}

inline const char* quant_path() {
#if ASYNCSERVE_QUANT_VNNI
  return "avx2+vnni";
#elif ASYNCSERVE_QUANT_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

constexpr int kQuantTile = 4;   // rows of x per pass over a decoded column

// The most rows for which quant_linear's int8 strategy runs the fused kernels (fused_tile: each block
// decoded in registers, no column buffer; AVX2 builds) instead of decoding each column once; read per
// call, set_quant_fused_rows changes it to compare the two. Measured on a 2-core Zen 3 (AVX2, scripts/
// bench_quant.py's shapes, 1 thread): fused 0.4-0.6x the columns' time at 1-4 rows for Q4_K / Q5_K / Q6_K,
// 0.65-0.85x at 5-8, Q8_0 0.75x throughout; Q4_0 / Q4_1 about even (their per-block float work is the same
// on both paths) to 1.1-1.3x slower at 8 rows. A decode step's rows, up to 8, run fused (Q4_0 / Q4_1 up to 4).
inline std::atomic<int64_t> quant_fused_rows{8};

// int8 activations and integer dot products (on at start), or fp32 activations against the column
// dequantized to fp32 (see the top); returns nothing, read per call.
inline std::atomic<bool> quant_int8_on{true};

// Rows from which quant_linear's int8 strategy runs the panel GEMM below (fewer: a column at a time),
// read per call; set_quant_panel_rows changes it to compare the two. Where panels are not built (no
// AVX2, or VNNI) it changes nothing. 8: on a Zen 3 core panels won from 4 rows (Q4_1, Q8_0) or 6 (Q4_K,
// Q6_K), at 8 rows by 1.1-1.9x; at 2 rows columns mostly won.
inline std::atomic<int64_t> quant_panel_rows{8};

// The rows from which a panel of Q5_K is decoded once per call (decode_q5k_panel) instead of in every tile;
// read per call, set_quant_q5k_decoded_rows changes it to compare the two. 12: on a Zen 3 core (2 threads,
// a 1B model's MLP shapes) once per call ran 0.80-0.83x at 4 rows, 0.92-1.04x at 8, 1.02-1.09x at 12-16 and
// 1.0-1.2x from 32.
inline std::atomic<int64_t> quant_q5k_decoded_rows{12};

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return float(c10::Half(bits, c10::Half::from_bits()));
}

// x quantized per block of 32: q [M][K] int8, d [M][K/32] scales, s16 [M][K/16] = d * sum of q over
// each 16 (what the offsets m multiply).
// Or, for the fp32 strategy, x as fp32 rows xf [M][K] alone.
// For Q4_K and Q5_K, x quantized per super-block of 256 too: q256 [M][K] int8, d256 [M][K/256] scales,
// sum32 [M][K/32] the sums of q256 over each 32 (|sum| <= 32 * 127: int16); q16 [M][K/16] the integer sums
// of q (per 32) over each 16, for Q6_K's panels.
struct QuantizedRows {
  LineVector<int8_t> q, q256;   // line-aligned: the AMX tiles load 64-byte rows of them
  std::vector<float> d, s16, xf, d256;
  std::vector<int16_t> sum32, q16;
  int64_t K = 0;
};

// One decoded column: q [K] bytes, scale and offset per 16 weights [K/16]; for the fp32 strategy
// also w [K], the weights themselves. Q4_K and Q5_K also keep their integer scales and mins per 32
// (sub_scale, sub_min [K/32]) and the fp16 d and dmin per 256 (super_d, super_dmin [K/256]).
struct DecodedColumn {
  std::vector<uint8_t> q;
  std::vector<float> scale, offset, w, super_d, super_dmin;
  std::vector<int16_t> sub_scale;
  std::vector<int32_t> sub_min;

  void resize(int64_t K, bool fp32) {
    q.resize(K);
    scale.resize(K / 16);
    offset.resize(K / 16);
    if (fp32) w.resize(K);
    sub_scale.resize(K / 32);
    sub_min.resize(K / 32);
    super_d.resize(K / 256);
    super_dmin.resize(K / 256);
  }
};

template <typename T>
inline void float_rows(const T* x, int64_t ldx, int64_t M, int64_t K, QuantizedRows& out) {
  out.K = K;
  out.xf.resize(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) out.xf[m * K + k] = to_float(x[m * ldx + k]);
}

// c.w = the decoded column's weights in fp32.
template <bool Signed>
inline void dequantize_column(DecodedColumn& c, int64_t K) {
#if ASYNCSERVE_QUANT_AVX2
  for (int64_t g = 0; g < K / 16; ++g) {
    const __m256 s = _mm256_set1_ps(c.scale[g]), o = _mm256_set1_ps(c.offset[g]);
    for (int h = 0; h < 16; h += 8) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c.q.data() + 16 * g + h));
      const __m256i qi = Signed ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
      _mm256_storeu_ps(c.w.data() + 16 * g + h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi), s, o));
    }
  }
#else
  for (int64_t g = 0; g < K / 16; ++g) {
    const float s = c.scale[g], o = c.offset[g];
    for (int i = 0; i < 16; ++i) {
      const float q = Signed ? float(int8_t(c.q[16 * g + i])) : float(c.q[16 * g + i]);
      c.w[16 * g + i] = s * q + o;
    }
  }
#endif
}

#if ASYNCSERVE_QUANT_AVX2
inline __m256 floats8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 floats8(const bf16* x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}

inline int sum_lanes_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#endif

// One block of x (32 or 256 values): d = max |x| / 127 (returned), q = x / d rounded to nearest even, and
// sums[h] = the sum of q over each `part` values (16 or 32). The vector path gives the scalar one's bits: the
// same lanes of maxima (a NaN skipped, as std::max(lane, NaN) does), products and rounding (cvtps's default).
template <typename T>
inline float quantize_block(const T* x, int block, int part, int8_t* q, int* sums) {
#if ASYNCSERVE_QUANT_AVX2
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 lanes = _mm256_setzero_ps();
  for (int i = 0; i < block; i += 8) lanes = _mm256_max_ps(_mm256_and_ps(floats8(x + i), magnitude), lanes);
  float lane[8];
  _mm256_storeu_ps(lane, lanes);
#else
  float lane[8] = {};   // max |x| per lane: a max in 8 lanes vectorises, its value is the same
  for (int i = 0; i < block; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] = std::max(lane[l], std::fabs(to_float(x[i + l])));
#endif
  float amax = 0.0f;
  for (float l : lane) amax = std::max(amax, l);
  const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
#if ASYNCSERVE_QUANT_AVX2
  const __m256 scale = _mm256_set1_ps(inv);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   // packs interleave the lanes' halves
  for (int i = 0; i < block; i += 32) {
    __m256i v[4];   // |v| <= 127: see dot_bytes
    for (int j = 0; j < 4; ++j) v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(floats8(x + i + 8 * j), scale));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i first = _mm256_add_epi32(v[0], v[1]), second = _mm256_add_epi32(v[2], v[3]);
    if (part == 16) {
      sums[i / 16] = sum_lanes_epi32(first);
      sums[i / 16 + 1] = sum_lanes_epi32(second);
    } else {
      sums[i / 32] = sum_lanes_epi32(_mm256_add_epi32(first, second));
    }
  }
#else
  for (int i = 0; i < block; ++i) q[i] = int8_t(std::nearbyint(to_float(x[i]) * inv));   // |q| <= 127: see dot_bytes
  for (int h = 0; h < block / part; ++h) {
    sums[h] = 0;
    for (int i = 0; i < part; ++i) sums[h] += q[part * h + i];
  }
#endif
  return d;
}

// x quantized per `block` (32 or 256) into a: per 32 q, d, the sums of q per 16 (q16) and s16 = d * them;
// per 256 q256, d256 and the sums sum32. Rows split over the threads from 4 each (a decode step's 16 rows:
// both cores).
template <typename T>
inline void quantize_rows(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t block, QuantizedRows& a) {
  LineVector<int8_t>& qs = block == 32 ? a.q : a.q256;
  std::vector<float>& ds = block == 32 ? a.d : a.d256;
  qs.resize(M * K);
  ds.resize(M * K / block);
  if (block == 32) {
    a.s16.resize(M * K / 16);
    a.q16.resize(M * K / 16);
  } else {
    a.sum32.resize(M * K / 32);
  }
  const int part = block == 32 ? 16 : 32;   // the sums' span
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    int sums[16];
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < K / block; ++b) {
        const float d = quantize_block(x + m * ldx + b * block, int(block), part, qs.data() + m * K + b * block, sums);
        ds[m * (K / block) + b] = d;
        for (int h = 0; h < block / part; ++h) {
          if (block == 32) {
            a.s16[m * (K / 16) + 2 * b + h] = d * float(sums[h]);
            a.q16[m * (K / 16) + 2 * b + h] = int16_t(sums[h]);
          } else {
            a.sum32[m * (K / 32) + 8 * b + h] = int16_t(sums[h]);
          }
        }
      }
  });
}

// 16 bytes of packed nibbles -> 32 values: the low nibbles, then the high ones.
inline void unpack_nibbles16(const uint8_t* in, uint8_t* out) {
#if ASYNCSERVE_QUANT_AVX2
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  const __m128i mask = _mm_set1_epi8(0x0F);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_and_si128(v, mask));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_and_si128(_mm_srli_epi16(v, 4), mask));
#else
  for (int i = 0; i < 16; ++i) {
    out[i] = in[i] & 0x0F;
    out[16 + i] = in[i] >> 4;
  }
#endif
}

// 32 bytes of packed nibbles -> the low nibbles (32 values) to lo, the high ones to hi; each value
// plus the bits of `high` (32 bytes, or null) selected by high_bit, shifted to bit 4 (Q5_K).
inline void unpack_nibbles32(const uint8_t* in, uint8_t* lo, uint8_t* hi, const uint8_t* high = nullptr,
                             int high_bit = 0) {
#if ASYNCSERVE_QUANT_AVX2
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256i l = _mm256_and_si256(v, mask), h = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  if (high) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high));
    const __m256i b0 = _mm256_set1_epi8(char(1 << high_bit)), b1 = _mm256_set1_epi8(char(2 << high_bit));
    const __m256i sixteen = _mm256_set1_epi8(0x10);
    l = _mm256_or_si256(l, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen));
    h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), l);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), h);
#else
  for (int i = 0; i < 32; ++i) {
    lo[i] = (in[i] & 0x0F) | (high ? ((high[i] >> high_bit) & 1) << 4 : 0);
    hi[i] = (in[i] >> 4) | (high ? ((high[i] >> (high_bit + 1)) & 1) << 4 : 0);
  }
#endif
}

// Decodes one column's row of blocks (K weights) so that w[i] = scale[i/16] * q[i] + offset[i/16].
template <int64_t Type>
inline void decode_column(const uint8_t* row, int64_t K, DecodedColumn& c) {
  uint8_t* q = c.q.data();
  float* scale = c.scale.data();
  float* offset = c.offset.data();
  constexpr QuantFormat f = Type == kQ4_0 ? QuantFormat{32, 18} : Type == kQ4_1 ? QuantFormat{32, 20}
                          : Type == kQ8_0 ? QuantFormat{32, 34} : Type == kQ4_K ? QuantFormat{256, 144}
                          : Type == kQ5_K ? QuantFormat{256, 176} : QuantFormat{256, 210};
  for (int64_t b = 0; b < K / f.block; ++b, row += f.bytes, q += f.block, scale += f.block / 16,
               offset += f.block / 16) {
    if constexpr (Type == kQ4_0 || Type == kQ4_1) {
      const float d = half_to_float(row), m = Type == kQ4_0 ? -8.0f * d : half_to_float(row + 2);
      unpack_nibbles16(row + (Type == kQ4_0 ? 2 : 4), q);
      scale[0] = scale[1] = d;
      offset[0] = offset[1] = m;
    } else if constexpr (Type == kQ8_0) {
      std::memcpy(q, row + 2, 32);
      scale[0] = scale[1] = half_to_float(row);
      offset[0] = offset[1] = 0.0f;
    } else if constexpr (Type == kQ4_K || Type == kQ5_K) {
      const float d = half_to_float(row), dmin = half_to_float(row + 2);
      int sc[8], mn[8];
      k_scales(row + 4, sc, mn);
      const uint8_t* qh = Type == kQ5_K ? row + 16 : nullptr;
      const uint8_t* qs = row + (Type == kQ5_K ? 48 : 16);
      for (int j = 0; j < 4; ++j)   // 32 bytes: chunk 2j in the low nibbles, 2j + 1 in the high ones
        unpack_nibbles32(qs + 32 * j, q + 64 * j, q + 64 * j + 32, qh, 2 * j);
      for (int j = 0; j < 8; ++j) {
        scale[2 * j] = scale[2 * j + 1] = d * float(sc[j]);
        offset[2 * j] = offset[2 * j + 1] = -dmin * float(mn[j]);
        c.sub_scale[8 * b + j] = int16_t(sc[j]);
        c.sub_min[8 * b + j] = mn[j];
      }
      c.super_d[b] = d;
      c.super_dmin[b] = dmin;
    } else {   // Q6_K: ql [128], qh [64], scales [16] int8, d
      const uint8_t* ql = row;
      const uint8_t* qh = row + 128;
      const auto* sc = reinterpret_cast<const int8_t*>(row + 192);
      const float d = half_to_float(row + 208);
      for (int half = 0; half < 2; ++half) {
        // chunk j of the half: nibbles (low for j < 2) of ql bytes 32 (j % 2).. and bits 2j of qh
        uint8_t* out = q + 128 * half;
        const uint8_t* l = ql + 64 * half;
        const uint8_t* h = qh + 32 * half;
#if ASYNCSERVE_QUANT_AVX2
        const __m256i mask = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(0x03);
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l + 32));
        const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
        const __m256i lows[4] = {_mm256_and_si256(l0, mask), _mm256_and_si256(l1, mask),
                                 _mm256_and_si256(_mm256_srli_epi16(l0, 4), mask),
                                 _mm256_and_si256(_mm256_srli_epi16(l1, 4), mask)};
        for (int j = 0; j < 4; ++j) {
          const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * j), three);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * j),
                              _mm256_or_si256(lows[j], _mm256_slli_epi16(hb, 4)));
        }
#else
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 32; ++i)
            out[32 * j + i] = ((l[32 * (j % 2) + i] >> (4 * (j / 2))) & 0x0F) | (((h[i] >> (2 * j)) & 3) << 4);
#endif
      }
      for (int g = 0; g < 16; ++g) {
        scale[g] = d * float(sc[g]);
        offset[g] = -32.0f * scale[g];
      }
    }
  }
}

// sum + a[i] * b[i] for the groups past dot_floats' multiples of 8, in order, one fused multiply-add
// each: written out so that the fused and the decoded-column paths give the same bits whatever the
// compiler contracts (a plain `sum += a * b` became an fma in one and not the other on a Zen 4 build)
inline float add_tail_products(float sum, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sum = std::fma(a[i], b[i], sum);
  return sum;
}

#if ASYNCSERVE_QUANT_AVX2

// 8 int32 lanes, lane l the sum over bytes 4l..4l+3 of w * x (w unsigned bytes <= 128 ... here
// <= 63 or Q8_0's |w| after the sign moved to x, x signed with |x| <= 127: no int16 saturation).
inline __m256i dot_bytes(__m256i w, __m256i x) {
#if ASYNCSERVE_QUANT_VNNI == 1
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif ASYNCSERVE_QUANT_VNNI == 2
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

// R rows of x (from row m) against the decoded column: their dot products without the offsets.
template <int R, bool Signed>
inline void dot_tile(const DecodedColumn& c, const QuantizedRows& a, int64_t m, float* out) {
  const int64_t K = a.K, chunks = K / 32;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < chunks; ++k) {
    __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.q.data() + 32 * k));
    const __m256i sign = w;
    if constexpr (Signed) w = _mm256_sign_epi8(w, w);   // |w|; x takes w's sign
    // lanes 0-3 cover the chunk's first 16 weights, 4-7 the next 16
    const __m256 s = _mm256_set_m128(_mm_set1_ps(c.scale[2 * k + 1]), _mm_set1_ps(c.scale[2 * k]));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m + r) * K + 32 * k));
      if constexpr (Signed) x = _mm256_sign_epi8(x, sign);
      const __m256 p = _mm256_cvtepi32_ps(dot_bytes(w, x));
      acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(s, _mm256_set1_ps(a.d[(m + r) * chunks + k])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum_lanes8(acc[r]);
}

// R rows of x quantized per 256 (from row m) against a Q4_K/Q5_K column, the offsets included: per
// super-block the chunks' byte products summed in pairs (vpmaddubsw: <= 2 * 31 * 127, no int16
// saturation), then in fours times the chunk's 6-bit scale (vpmaddwd by the scale), in int32 over
// the 8 chunks (<= 2^26), folded to float with d and the row's scale once.
template <int R>
inline void super_tile(const DecodedColumn& c, const QuantizedRows& a, int64_t m, float* out) {
  const int64_t K = a.K, supers = K / 256;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    // the 8 chunks' mins, one per lane, times the rows' sums of the chunk (<= 63 * 32 * 127)
    const __m256i mins = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.sub_min.data() + 8 * s));
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    for (int64_t k = 8 * s; k < 8 * s + 8; ++k) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.q.data() + 32 * k));
      const __m256i scale = _mm256_set1_epi16(c.sub_scale[k]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q256.data() + (m + r) * K + 32 * k));
        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), scale));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float dx = a.d256[(m + r) * supers + s];
      const __m256i xsum = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.sum32.data() + (m + r) * (K / 32) + 8 * s)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(c.super_d[s] * dx), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(mins, xsum)),
                               _mm256_set1_ps(-c.super_dmin[s] * dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum_lanes8(acc[r]);
}

// R fp32 rows of x (from row m) against the column's fp32 weights.
template <int R>
inline void float_tile(const DecodedColumn& c, const QuantizedRows& a, int64_t m, float* out) {
  const int64_t K = a.K;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 w = _mm256_loadu_ps(c.w.data() + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(a.xf.data() + (m + r) * K + k), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = sum_lanes8(acc[r]);
}

// sum of a[i] * b[i], n a multiple of 8 (8 lanes: the order of the sums is fixed, so results do not
// depend on the thread count)
inline float dot_floats(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return sum_lanes8(acc);
}

#else

template <int R>
inline void float_tile(const DecodedColumn& c, const QuantizedRows& a, int64_t m, float* out) {
  for (int r = 0; r < R; ++r) {
    float acc = 0.0f;
    for (int64_t k = 0; k < a.K; ++k) acc += c.w[k] * a.xf[(m + r) * a.K + k];
    out[r] = acc;
  }
}

inline float dot_floats(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

template <int R>
inline void super_tile(const DecodedColumn& c, const QuantizedRows& a, int64_t m, float* out) {
  const int64_t K = a.K, supers = K / 256;
  for (int r = 0; r < R; ++r) {
    const int8_t* x = a.q256.data() + (m + r) * K;
    const int16_t* xsum = a.sum32.data() + (m + r) * (K / 32);
    float acc = 0.0f;
    for (int64_t s = 0; s < supers; ++s) {
      int32_t sum = 0, offsets = 0;
      for (int64_t k = 8 * s; k < 8 * s + 8; ++k) {
        int32_t p = 0;
        for (int i = 0; i < 32; ++i) p += int32_t(c.q[32 * k + i]) * x[32 * k + i];
        sum += c.sub_scale[k] * p;
        offsets += c.sub_min[k] * xsum[k];
      }
      const float dx = a.d256[(m + r) * supers + s];
      acc += c.super_d[s] * dx * float(sum) - c.super_dmin[s] * dx * float(offsets);
    }
    out[r] = acc;
  }
}

template <int R, bool Signed>
inline void dot_tile(const DecodedColumn& c, const QuantizedRows& a, int64_t m, float* out) {
  const int64_t K = a.K, chunks = K / 32;
  for (int r = 0; r < R; ++r) {
    const int8_t* x = a.q.data() + (m + r) * K;
    float acc = 0.0f;
    for (int64_t k = 0; k < chunks; ++k) {
      int32_t p[2] = {0, 0};
      for (int i = 0; i < 32; ++i)
        p[i / 16] += (Signed ? int32_t(int8_t(c.q[32 * k + i])) : int32_t(c.q[32 * k + i])) * x[32 * k + i];
      acc += a.d[(m + r) * chunks + k] * (c.scale[2 * k] * float(p[0]) + c.scale[2 * k + 1] * float(p[1]));
    }
    out[r] = acc;
  }
}

#endif

#if ASYNCSERVE_QUANT_AVX2

// Few rows (a decode step's, M <= quant_fused_rows): there decoding a column into DecodedColumn costs
// more than reading its blocks from memory, so each block is decoded in registers and goes straight into
// the integer dot products of a tile of R rows, as llama.cpp's ggml_vec_dot_*_q8 do (nothing stored;
// the next blocks of the thread's contiguous columns stream in behind the hardware prefetcher). The
// products, scales and the order of every fp32 sum are those of dot_tile / super_tile and the offsets'
// dot_floats, so a row's results are the same bits on either path. At 5..8 rows the tile runs twice
// over the column's blocks, still in L1.

// k_scales on 4 words: bytes 0-7 of the result the 8 chunks' 6-bit scales, 8-15 their mins.
inline __m128i k_scales_mins(const uint8_t* s) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  u[3] = ((u[2] >> 4) & 0x0F0F0F0F) | (((u[1] >> 6) & 0x03030303) << 4);
  const uint32_t mins_low = u[1] & 0x3F3F3F3F;
  u[1] = (u[2] & 0x0F0F0F0F) | (((u[0] >> 6) & 0x03030303) << 4);
  u[2] = mins_low;
  u[0] &= 0x3F3F3F3F;
  return _mm_set_epi32(int(u[3]), int(u[2]), int(u[1]), int(u[0]));
}

// Q4_0 / Q4_1 / Q8_0: one block's 32 weights as bytes (Q8_0's signed), in order.
template <int64_t Type>
inline __m256i block32_bytes(const uint8_t* block) {
  if constexpr (Type == kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (Type == kQ4_0 ? 2 : 4)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

// R rows of x (from row m) against one column's Q4_0 / Q4_1 / Q8_0 blocks (at `column`), the offsets included
// (dot_tile and the offsets' dot_floats: 8 lanes of 4 blocks' two groups each, the last K/32 % 4 blocks after).
template <int R, int64_t Type>
inline void fused_block32_tile(const uint8_t* column, const QuantizedRows& a, int64_t m, float* out) {
  constexpr bool kSigned = Type == kQ8_0;
  constexpr int64_t kBytes = quant_format(Type).bytes;
  const int64_t K = a.K, chunks = K / 32, groups = K / 16;
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  float offsets[8];   // the groups' offsets of the last 4 blocks
  for (int64_t k = 0; k < chunks; ++k) {
    const uint8_t* block = column + k * kBytes;
    const float d = half_to_float(block);
    const __m256i sign = block32_bytes<Type>(block);
    const __m256i w = kSigned ? _mm256_sign_epi8(sign, sign) : sign;   // |w|; x takes w's sign
    const __m256 s = _mm256_set1_ps(d);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m + r) * K + 32 * k));
      if constexpr (kSigned) x = _mm256_sign_epi8(x, sign);
      const __m256 p = _mm256_cvtepi32_ps(dot_bytes(w, x));
      acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(s, _mm256_set1_ps(a.d[(m + r) * chunks + k])), acc[r]);
    }
    if constexpr (!kSigned) {
      offsets[2 * (k % 4)] = offsets[2 * (k % 4) + 1] = Type == kQ4_0 ? -8.0f * d : half_to_float(block + 2);
      if (k % 4 == 3) {
        const __m256 o = _mm256_loadu_ps(offsets);
        for (int r = 0; r < R; ++r)
          off[r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(a.s16.data() + (m + r) * groups + 2 * (k - 3)), off[r]);
      }
    }
  }
  const int64_t body = groups / 8 * 8;
  for (int r = 0; r < R; ++r) {
    float offset = kSigned ? 0.0f : sum_lanes8(off[r]);
    if constexpr (!kSigned) offset = add_tail_products(offset, offsets, a.s16.data() + (m + r) * groups + body, groups - body);
    out[r] = sum_lanes8(acc[r]) + offset;
  }
}

// R rows of x quantized per 256 (from row m) against one column's Q4_K / Q5_K blocks: super_tile's sums.
template <int R, int64_t Type>
inline void fused_super_tile(const uint8_t* column, const QuantizedRows& a, int64_t m, float* out) {
  constexpr int64_t kBytes = quant_format(Type).bytes;
  const int64_t K = a.K, supers = K / 256;
  const __m256i mask = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(0x10);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* block = column + s * kBytes;
    const float d = half_to_float(block), dmin = half_to_float(block + 2);
    const __m128i scales_mins = k_scales_mins(block + 4);
    const __m256i mins = _mm256_cvtepu8_epi32(_mm_srli_si128(scales_mins, 8));
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scales_mins));   // int16 lane j: chunk j's
    const uint8_t* qs = block + (Type == kQ5_K ? 48 : 16);
    const __m256i qh = Type == kQ5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16))
                                     : _mm256_setzero_si256();
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {   // 32 bytes: chunk 2j in the low nibbles, 2j + 1 in the high ones
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      if constexpr (Type == kQ5_K) {   // bit 2j (2j + 1) of qh to bit 4 of each byte
        const __m256i bit_lo = j < 2 ? _mm256_slli_epi16(qh, 4 - 2 * j) : _mm256_srli_epi16(qh, 2 * j - 4);
        const __m256i bit_hi = j < 2 ? _mm256_slli_epi16(qh, 3 - 2 * j) : _mm256_srli_epi16(qh, 2 * j - 3);
        lo = _mm256_or_si256(lo, _mm256_and_si256(bit_lo, sixteen));
        hi = _mm256_or_si256(hi, _mm256_and_si256(bit_hi, sixteen));
      }
      const __m256i scale_lo = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(int16_t(0x0100 + 0x0202 * (2 * j))));
      const __m256i scale_hi = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(int16_t(0x0100 + 0x0202 * (2 * j + 1))));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.q256.data() + (m + r) * K + 256 * s + 64 * j;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), scale_lo));
        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), scale_hi));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float dx = a.d256[(m + r) * supers + s];
      const __m256i xsum = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.sum32.data() + (m + r) * (K / 32) + 8 * s)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(d * dx), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(mins, xsum)), _mm256_set1_ps(-dmin * dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum_lanes8(acc[r]);
}

// R rows of x (from row m) against one column's Q6_K blocks, the offsets included (dot_tile, dot_floats).
template <int R>
inline void fused_q6k_tile(const uint8_t* column, const QuantizedRows& a, int64_t m, float* out) {
  const int64_t K = a.K, chunks = K / 32, groups = K / 16;
  const __m256i mask = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(0x03);
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* block = column + s * 210;   // ql [128], qh [64], scales [16] int8, d
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    const __m256 d = _mm256_set1_ps(half_to_float(block + 208));
    // the 16 groups' scales d sc and offsets -32 d sc
    const __m256 scale[2] = {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d),
                             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d)};
    for (int h = 0; h < 2; ++h) {
      const __m256 o = _mm256_mul_ps(scale[h], _mm256_set1_ps(-32.0f));
      for (int r = 0; r < R; ++r)
        off[r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(a.s16.data() + (m + r) * groups + 16 * s + 8 * h), off[r]);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {   // decode_column's halves: chunk j of 4 from ql's nibbles and qh's bits 2j
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32));
      const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i low = _mm256_and_si256(j < 2 ? (j == 0 ? l0 : l1) : _mm256_srli_epi16(j == 2 ? l0 : l1, 4), mask);
        const __m256i w = _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2 * j), three), 4));
        const int64_t k = 8 * s + 4 * h + j;   // the chunk; its groups' scales in lanes 0-3 and 4-7
        const __m256 sk = _mm256_permutevar8x32_ps(scale[h], _mm256_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                                                                2 * j, 2 * j, 2 * j, 2 * j));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m + r) * K + 32 * k));
          const __m256 p = _mm256_cvtepi32_ps(dot_bytes(w, x));
          acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(sk, _mm256_set1_ps(a.d[(m + r) * chunks + k])), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum_lanes8(acc[r]) + sum_lanes8(off[r]);
}

// R rows of x (from row m) against one column's blocks of Type: its finished dot products.
template <int R, int64_t Type>
inline void fused_tile(const uint8_t* column, const QuantizedRows& a, int64_t m, float* out) {
  if constexpr (Type == kQ4_K || Type == kQ5_K) fused_super_tile<R, Type>(column, a, m, out);
  else if constexpr (Type == kQ6_K) fused_q6k_tile<R>(column, a, m, out);
  else fused_block32_tile<R, Type>(column, a, m, out);
}

#endif

// Rows [0, M) in tiles of up to kQuantTile: tile(std::integral_constant<int, R>, m, dots) fills dots[0, R)
// for rows m.., then store(row, dot) takes each.
template <typename Tile, typename Store>
inline void over_row_tiles(int64_t M, Tile tile, Store store) {
  for (int64_t m = 0; m < M; m += kQuantTile) {
    float dots[kQuantTile];
    const int64_t rows = std::min<int64_t>(kQuantTile, M - m);
    switch (rows) {
      case 4: tile(std::integral_constant<int, 4>{}, m, dots); break;
      case 3: tile(std::integral_constant<int, 3>{}, m, dots); break;
      case 2: tile(std::integral_constant<int, 2>{}, m, dots); break;
      default: tile(std::integral_constant<int, 1>{}, m, dots); break;
    }
    for (int64_t r = 0; r < rows; ++r) store(m + r, dots[r]);
  }
}

// Columns [n0, n1) of one part: y[m][col0 + n] for every row m of a.
template <int64_t Type, typename T>
inline void quant_columns(const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1, const QuantizedRows& a,
                          int64_t M, T* y, int64_t ldy, int64_t col0, DecodedColumn& c, bool int8) {
  constexpr bool kSigned = Type == kQ8_0;
  const int64_t K = a.K, groups = K / 16;
#if ASYNCSERVE_QUANT_AVX2
  // Q4_0 / Q4_1 fused within one tile of rows only: each further tile would redo the per-block scale and
  // offset work that a decoded column holds once (measured 1.1-1.3x slower at 8 rows, even at 1-4)
  const int64_t fused_rows = quant_fused_rows.load(std::memory_order_relaxed);
  if (int8 && M <= (Type == kQ4_0 || Type == kQ4_1 ? std::min<int64_t>(fused_rows, kQuantTile) : fused_rows)) {
    for (int64_t n = n0; n < n1; ++n)
      over_row_tiles(
          M, [&](auto R, int64_t m, float* dots) { fused_tile<decltype(R)::value, Type>(blocks + n * row_bytes, a, m, dots); },
          [&](int64_t row, float dot) { y[row * ldy + col0 + n] = from_float<T>(dot); });
    return;
  }
#endif
  for (int64_t n = n0; n < n1; ++n) {
    decode_column<Type>(blocks + n * row_bytes, K, c);
    const auto store = [&](int64_t row, float dot) { y[row * ldy + col0 + n] = from_float<T>(dot); };
    if (!int8) {
      dequantize_column<kSigned>(c, K);
      over_row_tiles(M, [&](auto R, int64_t m, float* dots) { float_tile<decltype(R)::value>(c, a, m, dots); }, store);
      continue;
    }
    if constexpr (Type == kQ4_K || Type == kQ5_K) {
      over_row_tiles(M, [&](auto R, int64_t m, float* dots) { super_tile<decltype(R)::value>(c, a, m, dots); }, store);
      continue;
    }
    over_row_tiles(
        M, [&](auto R, int64_t m, float* dots) { dot_tile<decltype(R)::value, kSigned>(c, a, m, dots); },
        [&](int64_t row, float dot) {
          // Q8_0 has no offsets; K is a multiple of 32, so there are 2, 4, 6, ... groups: the tail of 8 runs here
          const float* s16 = a.s16.data() + row * groups;
          const int64_t body = groups / 8 * 8;
          float off = kSigned ? 0.0f : dot_floats(c.offset.data(), s16, body);
          if constexpr (!kSigned) off = add_tail_products(off, c.offset.data() + body, s16 + body, groups - body);
          store(row, dot + off);
        });
  }
}

// Many rows (a prefill's, M >= quant_panel_rows): a GEMM over panels of 8 columns. A thread decodes a
// panel's 8 columns once, in registers (build_panel: each block's chunks of 32 weights of the 8 columns
// transposed, their scales gathered across the columns: at a decode step's 16 rows a pass through
// per-column buffers cost about as much as the dot products), 4 consecutive weights of column n in bytes
// 4n..4n+3 of each 32-byte vector, so that one vpmaddubsw against 4 bytes of a row of x broadcast to
// all lanes gives, in int32 lane n after vpmaddwd, column n's dot over those 4 weights: the lanes are
// the columns, the column scales are one vector, and a tile of kPanelRows rows x 8 columns keeps its
// accumulators in registers, each weight vector loaded once for the tile's rows. The products add up
// in int16 for as many steps as cannot saturate (the bytes' maximum: 15 for Q4_0 / Q4_1 / Q4_K, 31 for
// Q5_K, 63 for Q6_K, |w| <= 128 for Q8_0, whose sign moves to x), then in int32 per group, folded to
// float per group of 32 (16 for Q6_K) with the column scales and offsets, or for Q4_K and Q5_K per
// super-block of 256 after the 6-bit scales multiply in int32 (vpmaddwd by the scale) and the mins
// likewise multiply the activations' per-32 sums. The activations are quantized as for the few-row
// path. While a panel's tiles run, the thread asks for its next panel's blocks (PanelAhead). AVX2 (and
// F16C), with vpdpbusd in place of vpmaddubsw where the CPU has VNNI (add_products below).
#if ASYNCSERVE_QUANT_AVX2 && defined(__F16C__)
#define ASYNCSERVE_QUANT_PANEL 1

constexpr int kPanel = 8;              // columns per panel: the int32 lanes of a vector
constexpr int kPanelRows = 4;          // rows per tile: each weight vector loaded once for them

// One panel's 8 columns (a short last panel repeats its last column), decoded and interleaved.
struct Panel {
  std::vector<uint8_t> q;               // [K/4][8 columns][4 weights]
  std::vector<float> scale, offset;     // [K/G][8]: per group of G = 32 (16 for Q6_K) weights
  std::vector<int16_t> sub_scale;       // [K/32][16]: Q4_K/Q5_K's 6-bit scale of column n in int16 lanes 2n, 2n+1
  std::vector<int16_t> sub_min;         // [K/64][16]: mins of chunks 2i (lane 2n) and 2i + 1 (lane 2n + 1)
  std::vector<float> super_d, super_dmin;   // [K/256][8]

  void resize(int64_t K) {
    q.resize(K * kPanel);
    scale.resize(K / 16 * kPanel);
    offset.resize(K / 16 * kPanel);
    sub_scale.resize(K / 32 * 16);
    sub_min.resize(K / 64 * 16);
    super_d.resize(K / 256 * kPanel);
    super_dmin.resize(K / 256 * kPanel);
  }
};

// r[n] (n < 8: 8 words each) -> r[t] word n = the old r[n] word t: an 8x8 transpose of 32-bit words.
inline void transpose_words(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int n = 0; n < 8; n += 2) {
    t[n] = _mm256_unpacklo_epi32(r[n], r[n + 1]);       // words 0, 1 | 4, 5 of rows n, n + 1
    t[n + 1] = _mm256_unpackhi_epi32(r[n], r[n + 1]);   // words 2, 3 | 6, 7
  }
  for (int n = 0; n < 8; n += 4)
    for (int h = 0; h < 2; ++h) {
      u[n + 2 * h] = _mm256_unpacklo_epi64(t[n + h], t[n + 2 + h]);       // word 2h | 2h + 4 of rows n..n+3
      u[n + 2 * h + 1] = _mm256_unpackhi_epi64(t[n + h], t[n + 2 + h]);   // word 2h + 1 | 2h + 5
    }
  for (int w = 0; w < 4; ++w) {
    r[w] = _mm256_permute2x128_si256(u[w], u[4 + w], 0x20);
    r[4 + w] = _mm256_permute2x128_si256(u[w], u[4 + w], 0x31);
  }
}

// h[n] (n < 8: 16 bytes each) -> h[i] bytes 0-7 = byte 2i of each old h[n] in order, bytes 8-15 = byte 2i + 1.
inline void transpose_bytes(__m128i h[8]) {
  __m128i a[8], b[8];
  for (int n = 0; n < 8; n += 2) {
    a[n] = _mm_unpacklo_epi8(h[n], h[n + 1]);       // bytes 0..7 of rows n, n + 1, in pairs
    a[n + 1] = _mm_unpackhi_epi8(h[n], h[n + 1]);   // bytes 8..15
  }
  for (int n = 0; n < 8; n += 4)
    for (int half = 0; half < 2; ++half) {
      b[n + 2 * half] = _mm_unpacklo_epi16(a[n + half], a[n + 2 + half]);       // 4 bytes of rows n..n+3 ...
      b[n + 2 * half + 1] = _mm_unpackhi_epi16(a[n + half], a[n + 2 + half]);   // ... per byte index
    }
  for (int i = 0; i < 4; ++i) {   // b[i]: bytes 4i..4i+3 of rows 0..3, b[4 + i] of rows 4..7
    h[2 * i] = _mm_unpacklo_epi32(b[i], b[4 + i]);
    h[2 * i + 1] = _mm_unpackhi_epi32(b[i], b[4 + i]);
  }
}

// The fp16 at `offset` in each of the 8 columns' blocks, as floats (lane n: column n's).
inline __m256 halves8(const uint8_t* const col[kPanel], int64_t offset) {
  uint16_t h[kPanel];
  for (int n = 0; n < kPanel; ++n) std::memcpy(h + n, col[n] + offset, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// Chunk c (32 weights) of one block of Type as decode_column's bytes (Q8_0's signed), decoded in registers.
template <int64_t Type>
inline __m256i chunk_bytes(const uint8_t* block, int c) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  if constexpr (Type == kQ4_0 || Type == kQ4_1 || Type == kQ8_0) {
    return block32_bytes<Type>(block);
  } else if constexpr (Type == kQ4_K || Type == kQ5_K) {   // 32 bytes: chunk 2j in the low nibbles, 2j + 1 in the high
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (Type == kQ5_K ? 48 : 16) + 32 * (c / 2)));
    __m256i q = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(v, 4) : v, mask);
    if constexpr (Type == kQ5_K) {   // bit c of qh to bit 4 of each byte
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
      const __m256i bit = c < 4 ? _mm256_slli_epi16(qh, 4 - c) : _mm256_srli_epi16(qh, c - 4);
      q = _mm256_or_si256(q, _mm256_and_si256(bit, _mm256_set1_epi8(0x10)));
    }
    return q;
  } else {   // Q6_K: chunk j of half h from ql's nibbles (low for j < 2) of bytes 64 h + 32 (j % 2).., qh's bits 2j
    const int h = c / 4, j = c % 4;
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32 * (j % 2)));
    const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
    const __m256i low = _mm256_and_si256(j < 2 ? l : _mm256_srli_epi16(l, 4), mask);
    return _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2 * j), _mm256_set1_epi8(0x03)), 4));
  }
}

// Decodes columns [n0, n0 + valid) of the blocks into the panel, in registers: each block's chunks of the
// 8 columns transposed to lanes, its scales gathered across the columns (the values decode_column gives).
template <int64_t Type>
inline void build_panel(const uint8_t* blocks, int64_t row_bytes, int64_t n0, int valid, int64_t K, Panel& p) {
  constexpr QuantFormat f = quant_format(Type);
  constexpr int kChunks = int(f.block / 32);
  const uint8_t* col[kPanel];
  for (int n = 0; n < kPanel; ++n) col[n] = blocks + (n0 + std::min(n, valid - 1)) * row_bytes;
  for (int64_t b = 0; b < K / f.block; ++b) {
    const int64_t at = b * f.bytes;
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) {
      __m256i r[kPanel];
      for (int n = 0; n < kPanel; ++n) r[n] = chunk_bytes<Type>(col[n] + at, c);
      transpose_words(r);
      __m256i* o = reinterpret_cast<__m256i*>(p.q.data() + 256 * (kChunks * b + c));
      for (int t = 0; t < 8; ++t) _mm256_storeu_si256(o + t, r[t]);
    }
    if constexpr (Type == kQ4_K || Type == kQ5_K) {
      __m128i sm[kPanel];   // per column: bytes 0-7 the chunks' scales, 8-15 their mins; then per chunk pair
      for (int n = 0; n < kPanel; ++n) sm[n] = k_scales_mins(col[n] + at + 4);
      transpose_bytes(sm);   // sm[i]: scales (i < 4) or mins (i >= 4) of chunks 2i % 8 and 2i % 8 + 1, by column
      for (int i = 0; i < 4; ++i)
        for (int h = 0; h < 2; ++h) {   // chunk 2i + h's scales, each in both int16 halves of its column's lane
          const __m256i v = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(sm[i], 8) : sm[i]);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.sub_scale.data() + 16 * (8 * b + 2 * i + h)),
                              _mm256_or_si256(v, _mm256_slli_epi32(v, 16)));
        }
      for (int i = 0; i < 4; ++i)       // lane n: the mins of chunks 2i and 2i + 1 of column n
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.sub_min.data() + 16 * (4 * b + i)),
                            _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sm[4 + i], _mm_srli_si128(sm[4 + i], 8))));
      _mm256_storeu_ps(p.super_d.data() + kPanel * b, halves8(col, at));
      _mm256_storeu_ps(p.super_dmin.data() + kPanel * b, halves8(col, at + 2));
    } else if constexpr (Type == kQ6_K) {   // 16 groups: scale d sc, offset -32 d sc
      const __m256 d = halves8(col, at + 208);
      __m128i sc[kPanel];
      for (int n = 0; n < kPanel; ++n) sc[n] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(col[n] + at + 192));
      transpose_bytes(sc);
      for (int g = 0; g < 16; ++g) {
        const __m128i bytes = g % 2 ? _mm_srli_si128(sc[g / 2], 8) : sc[g / 2];
        const __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
        _mm256_storeu_ps(p.scale.data() + kPanel * (16 * b + g), scale);
        _mm256_storeu_ps(p.offset.data() + kPanel * (16 * b + g), _mm256_mul_ps(scale, _mm256_set1_ps(-32.0f)));
      }
    } else {   // one group of 32: Q4_0 d and -8 d, Q4_1 d and m, Q8_0 d and none
      const __m256 d = halves8(col, at);
      _mm256_storeu_ps(p.scale.data() + kPanel * b, d);
      _mm256_storeu_ps(p.offset.data() + kPanel * b, Type == kQ4_0 ? _mm256_mul_ps(d, _mm256_set1_ps(-8.0f))
                                                      : Type == kQ4_1 ? halves8(col, at + 2) : _mm256_setzero_ps());
    }
  }
}

// The 4 bytes at x (a row's 4 int8 at k, or 2 int16 sums), in every 32-bit lane.
inline __m256i broadcast4(const void* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

// The next panel's blocks (one contiguous range: its 8 columns' rows), asked for into L2 two lines per
// step of a tile's k loop, so that they arrive while this panel's dot products run: building a panel
// would otherwise wait on DRAM with the arithmetic idle (the blocks are read once per call).
struct PanelAhead {
  const char* line;
  const char* end;

  inline void next() {
    for (int i = 0; i < 2 && line < end; ++i, line += 64) __builtin_prefetch(line, 0, 2);
  }
};

// An empty asm that "changes" the R sums: gcc must add each step's products to them in turn, instead of
// hoisting all the products of the unrolled steps first and spilling them (what it does otherwise).
template <int R>
inline void in_order(__m256i (&v)[R]) {
  for (int r = 0; r < R; ++r) asm("" : "+x"(v[r]));
}

// The panels' dot products, added up by step (4 weights) in `part`: without VNNI the byte products add in
// int16 (vpmaddubsw, 2 per lane: the callers keep them within its range, then vpmaddwd), with VNNI in int32
// (vpdpbusd, 4 per lane: no range to keep, one instruction where AVX2 takes two).
constexpr bool kVnniPanels = ASYNCSERVE_QUANT_VNNI != 0;

// part + the products of w's unsigned bytes and x's signed ones.
inline __m256i add_products(__m256i part, __m256i w, __m256i x) {
#if ASYNCSERVE_QUANT_VNNI == 1
  return _mm256_dpbusd_epi32(part, w, x);
#elif ASYNCSERVE_QUANT_VNNI == 2
  return _mm256_dpbusd_avx_epi32(part, w, x);
#else
  return _mm256_add_epi16(part, _mm256_maddubs_epi16(w, x));
#endif
}

// part's sums in int32 lanes times each lane's scale (given in both int16 halves of the lane).
inline __m256i scaled_sums(__m256i part, __m256i scale) {
  return kVnniPanels ? _mm256_mullo_epi32(part, _mm256_srai_epi32(scale, 16)) : _mm256_madd_epi16(part, scale);
}

// part's sums in int32 lanes.
inline __m256i summed(__m256i part) {
  return kVnniPanels ? part : _mm256_madd_epi16(part, _mm256_set1_epi16(1));
}

// Steps of 4 weights whose products can add up in one part (without VNNI: in int16, 2 products of <= max * 127
// per step each; with VNNI all of a group's, 8 steps or Q6_K's 4).
template <int64_t Type>
constexpr int int16_steps() {
  if (kVnniPanels) return Type == kQ6_K ? 4 : 8;
  return Type == kQ8_0 ? 1 : Type == kQ6_K ? 2 : Type == kQ5_K ? 4 : 8;
}

// R rows of x (from row m) against a panel of Q4_0 / Q4_1 / Q8_0 / Q6_K: acc[r] lane n = row r . column n.
template <int R, int64_t Type>
inline void panel_group_tile(const Panel& p, const QuantizedRows& a, int64_t m, __m256 acc[R], PanelAhead& ahead) {
  PanelAhead lines = ahead;   // in a register (the loads below may alias it)
  constexpr bool kSigned = Type == kQ8_0;
  constexpr int G = Type == kQ6_K ? 16 : 32, S = int16_steps<Type>();
  const int64_t K = a.K;
  const int8_t* x[R];
  const float *d[R], *s16[R];   // the rows' scales per 32 and offsets' sums per 16
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    x[r] = a.q.data() + (m + r) * K;
    d[r] = a.d.data() + (m + r) * (K / 32);
    s16[r] = a.s16.data() + (m + r) * (K / 16);
  }
  for (int64_t g = 0; g < K / G; ++g) {
    lines.next();
    __m256i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int h = 0; h < G / 4; h += S) {
      __m256i part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_si256();
      for (int t = 0; t < S; ++t) {
        const int64_t k = G * g + 4 * (h + t);
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.q.data() + 8 * k));
        const __m256i wu = kSigned ? _mm256_abs_epi8(w) : w;   // |w| <= 128 as unsigned; x takes w's sign
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          __m256i xb = broadcast4(x[r] + k);
          if constexpr (kSigned) xb = _mm256_sign_epi8(xb, w);
          part[r] = add_products(part[r], wu, xb);
        }
      }
      for (int r = 0; r < R; ++r) sum[r] = _mm256_add_epi32(sum[r], summed(part[r]));
    }
    const __m256 scale = _mm256_loadu_ps(p.scale.data() + kPanel * g);
    const __m256 offset = _mm256_loadu_ps(p.offset.data() + kPanel * g);
    const int64_t c = G == 32 ? g : g >> 1;   // the chunk of 32 (g >= 0)
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(scale, _mm256_set1_ps(d[r][c])), acc[r]);
      if constexpr (!kSigned) {
        const float* o = s16[r] + G / 16 * g;
        acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(G == 32 ? o[0] + o[1] : o[0]), acc[r]);
      }
    }
  }
  ahead = lines;
}

// acc[r] += the super-block s's integer sums of R rows (from row m) times d dx, less their mins (mn[i]: lane
// 2n, 2n + 1 column n's mins of chunks 2i, 2i + 1) times the rows' per-32 sums times dmin dx.
template <int R>
inline void fold_super(__m256 acc[R], const __m256i sum[R], const __m256i mn[4], __m256 d, __m256 dmin,
                       const QuantizedRows& a, int64_t m, int64_t s) {
  const int64_t K = a.K, supers = K / 256;
  for (int r = 0; r < R; ++r) {
    const int16_t* xs = a.sum32.data() + (m + r) * (K / 32) + 8 * s;
    __m256i mins = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) mins = _mm256_add_epi32(mins, _mm256_madd_epi16(broadcast4(xs + 2 * i), mn[i]));
    const __m256 dx = _mm256_set1_ps(a.d256[(m + r) * supers + s]);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(d, dx), acc[r]);
    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, dx), acc[r]);
  }
}

// R rows of x quantized per 256 (from row m) against a panel of Q4_K / Q5_K, the mins included.
// noinline here and in q4k_panel_tile: inlined into quant_linear's parallel loop, gcc kept the tile's int16
// sums on the stack, and the tiles ran 1.2x (Q4_K in panels) to 2x (Q5_K) slower at 16-64 rows.
template <int R, int64_t Type>
__attribute__((noinline)) void panel_super_tile(const Panel& p, const QuantizedRows& a, int64_t m, __m256 acc[R], PanelAhead& ahead) {
  PanelAhead lines = ahead;   // in a register (the loads below may alias it)
  constexpr int S = int16_steps<Type>();
  const int64_t K = a.K, supers = K / 256;
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    x[r] = a.q256.data() + (m + r) * K;
  }
  for (int64_t s = 0; s < supers; ++s) {
    __m256i sum[R];   // (the mins' sums come after: 16 vectors live in the chunks' loop would spill)
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int64_t j = 8 * s; j < 8 * s + 8; ++j) {   // chunks of 32: <= 2 * 8 * 15 * 127 * 63 per lane (Q4_K)
      lines.next();
      const __m256i scale = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.sub_scale.data() + 16 * j));
      for (int h = 0; h < 8; h += S) {
        __m256i part[R];
        for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int t = 0; t < S; ++t) {
          const int64_t k = 32 * j + 4 * (h + t);
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.q.data() + 8 * k));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) part[r] = add_products(part[r], w, broadcast4(x[r] + k));
          in_order(part);
        }
        for (int r = 0; r < R; ++r) sum[r] = _mm256_add_epi32(sum[r], scaled_sums(part[r], scale));
      }
    }
    __m256i mn[4];   // the mins of chunk pairs, times the rows' sums of them (|sum| <= 32 * 127: int16)
    for (int i = 0; i < 4; ++i) mn[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.sub_min.data() + 16 * (4 * s + i)));
    fold_super<R>(acc, sum, mn, _mm256_loadu_ps(p.super_d.data() + kPanel * s),
                  _mm256_loadu_ps(p.super_dmin.data() + kPanel * s), a, m, s);
  }
  ahead = lines;
}

// f(std::integral_constant<int, rows>) for rows in [1, R].
template <int R, typename F>
inline void with_rows(int rows, F f) {
  if constexpr (R > 1)
    if (rows < R) return with_rows<R - 1>(rows, f);
  f(std::integral_constant<int, R>{});
}

// Columns [n0, n0 + valid) of one part for every row of a, through the panel (built here); the tiles
// ask for the blocks of `ahead` (the thread's next panel) as they go.
template <int64_t Type, typename T>
inline void quant_panel(const uint8_t* blocks, int64_t row_bytes, int64_t n0, int valid, const QuantizedRows& a,
                        int64_t M, T* y, int64_t ldy, int64_t col0, Panel& p, PanelAhead ahead) {
  build_panel<Type>(blocks, row_bytes, n0, valid, a.K, p);
  for (int64_t m = 0; m < M; m += kPanelRows) {
    __m256 acc[kPanelRows];
    const int64_t rows = std::min<int64_t>(kPanelRows, M - m);
    with_rows<kPanelRows>(int(rows), [&](auto R) {
      if constexpr (Type == kQ4_K || Type == kQ5_K) panel_super_tile<decltype(R)::value, Type>(p, a, m, acc, ahead);
      else panel_group_tile<decltype(R)::value, Type>(p, a, m, acc, ahead);
    });
    for (int64_t r = 0; r < rows; ++r) {
      T* out = y + (m + r) * ldy + col0 + n0;
      if (std::is_same_v<T, float> && valid == kPanel) {
        _mm256_storeu_ps(reinterpret_cast<float*>(out), acc[r]);
        continue;
      }
      float v[kPanel];
      _mm256_storeu_ps(v, acc[r]);
      for (int n = 0; n < valid; ++n) out[n] = from_float<T>(v[n]);
    }
  }
}

// One line of the thread's next panel asked for into L2, while any is left (during a panel's first tile).
inline void ask_ahead(const char*& ahead, const char* ahead_end) {
  if (ahead < ahead_end) {
    __builtin_prefetch(ahead, 0, 2);
    ahead += 64;
  }
}

// A pair of steps of a panel tile: the 8 columns' weights k..k+3 (lo) and k+4..k+7 (hi) times R rows of x,
// added to part in order (in_order).
template <int R>
__attribute__((always_inline)) inline void add_pair(__m256i (&part)[R], __m256i lo, __m256i hi, const int8_t* const (&x)[R],
                                                    int64_t k) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    part[r] = add_products(part[r], lo, broadcast4(x[r] + k));
    part[r] = add_products(part[r], hi, broadcast4(x[r] + k + 4));
  }
  in_order(part);
}

// The fifth bits of pair p of a Q5_K panel's chunk (five_bit) ored in at bit 4: those of the low nibbles'
// weights into lo, of the high ones' into hi; `high` the chunk's bit bytes, shifted left by 4 from pair 2 on.
inline void or_fifth_bits(__m256i high, int p, __m256i& lo, __m256i& hi) {
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  const __m256i at = p % 2 ? _mm256_srli_epi16(high, 2) : high;   // this pair's bits at 4 and 5
  lo = _mm256_or_si256(lo, _mm256_and_si256(at, bit4));
  hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(at, 1), bit4));
}

// R rows of x quantized per 256 (from row m) against one panel of kQ4_K_Panels (or kQ5_K_Panels):
// panel_super_tile's sums, each pair of steps' weights decoded from one load in registers (Q5_K's fifth
// bits from one more load per chunk, or its weights read from the panel decoded per call; its products
// into int32 every two pairs: <= 4 * 2 * 31 * 127 in int16). Where `ahead` < `ahead_end` (the first tile
// of a panel), one line of the thread's next panel is asked for into L2 per pair of steps.
enum FifthBits { kNoFifth, kFifthInRegisters, kFifthDecoded };   // Q4_K; Q5_K decoded per tile, or per call

template <int R, FifthBits Fifth>
__attribute__((noinline)) void q4k_panel_tile(const uint8_t* panel, const QuantizedRows& a, int64_t m, __m256 acc[R], const char* ahead,
                           const char* ahead_end, const uint8_t* decoded) {
  constexpr bool Five = Fifth != kNoFifth;
  constexpr int64_t kBytes = Five ? kQ5KPanelBytes : kQ4KPanelBytes;
  const int64_t K = a.K, supers = K / 256;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    x[r] = a.q256.data() + (m + r) * K;
  }
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* block = panel + s * kBytes;
    __m256i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {   // chunks of 32: the 8 steps' products add up in int16 (<= 2 * 8 * 15 * 127)
      const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 1024 + 8 * j)));
      const __m256i scale = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));   // column n's in int16 lanes 2n, 2n + 1
      // Q5_K: the fifth bits (five_bit): pairs 0-1 at bits 4-7, then pairs 2-3 moved there
      __m256i high = Fifth == kFifthInRegisters
                         ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kQ4KPanelBytes + 32 * j))
                         : _mm256_setzero_si256();
      __m256i part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        ask_ahead(ahead, ahead_end);
        __m256i lo, hi;
        if constexpr (Fifth == kFifthDecoded) {
          const uint8_t* pair = decoded + 2048 * s + 64 * (4 * j + p);
          lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
          hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 32));
        } else {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * (4 * j + p)));
          lo = _mm256_and_si256(v, mask);
          hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        }
        if constexpr (Fifth == kFifthInRegisters) {
          if (p == 2) high = _mm256_slli_epi16(high, 4);
          or_fifth_bits(high, p, lo, hi);
        }
        add_pair<R>(part, lo, hi, x, 256 * s + 32 * j + 8 * p);
        if (Five && !kVnniPanels && p % 2 == 1)
          for (int r = 0; r < R; ++r) {
            sum[r] = _mm256_add_epi32(sum[r], scaled_sums(part[r], scale));
            part[r] = _mm256_setzero_si256();
          }
      }
      if constexpr (!Five || kVnniPanels)
        for (int r = 0; r < R; ++r) sum[r] = _mm256_add_epi32(sum[r], scaled_sums(part[r], scale));
    }
    __m256i mn[4];
    for (int i = 0; i < 4; ++i)
      mn[i] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 1088 + 16 * i)));
    fold_super<R>(acc, sum, mn, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 1152))),
                  _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 1168))), a, m, s);
  }
}

// R rows of x quantized per 32 (from row m) against one panel of kQ6_K_Panels: per pair of steps the weights'
// low nibbles and high bit pairs combined in registers, their products (<= 2 * 2 * 63 * 127 in int16) times
// the group's int8 scale into int32 (vpmaddwd), less 32 sc times the rows' per-16 sums, one float fold per
// chunk of 32 (the rows' scales); `ahead` as Q4_K's. The activations per 32, as the blocks' kernels have
// them: per 256 (llama.cpp's q8_K) moved a tiny model's greedy tokens off its reference more often.
template <int R>
inline void q6k_panel_tile(const uint8_t* panel, const QuantizedRows& a, int64_t m, __m256 acc[R], const char* ahead,
                           const char* ahead_end) {
  const int64_t K = a.K, supers = K / 256;
  const __m256i mask = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(0x03);
  // int16 lane 2n of an int16 pair per column to both of the column's lanes (even), or lane 2n + 1 (odd)
  const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                        0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
  const __m256i odd = _mm256_add_epi8(even, _mm256_set1_epi8(2));
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    x[r] = a.q.data() + (m + r) * K;
  }
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* block = panel + s * kQ6KPanelBytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 1664)));
    for (int j = 0; j < 8; ++j) {
      // groups 2j, 2j + 1: their scales, and the offsets -32 sc times the rows' sums of them
      const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 1536 + 16 * j)));
      __m256i sum[R];
      for (int r = 0; r < R; ++r)
        sum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(
                                      broadcast4(a.q16.data() + (m + r) * (K / 16) + 16 * s + 2 * j), scales), 5));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i scale = _mm256_shuffle_epi8(scales, h ? odd : even);
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 1024 + 32 * (2 * j + h)));
        __m256i part[R];   // with VNNI: the group's 16 weights' products (without: each half's, to int32 at once)
        for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          ask_ahead(ahead, ahead_end);
          const int p = 2 * h + half;
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * (4 * j + p)));
          const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, mask),
                                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4 * half), three), 4));
          const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
                                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4 * half + 2), three), 4));
          const int64_t k = 256 * s + 32 * j + 8 * p;
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            if constexpr (kVnniPanels) {
              part[r] = add_products(add_products(part[r], lo, broadcast4(x[r] + k)), hi, broadcast4(x[r] + k + 4));
            } else {
              const __m256i half_part = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(x[r] + k)),
                                                         _mm256_maddubs_epi16(hi, broadcast4(x[r] + k + 4)));
              sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(half_part, scale));
            }
          }
        }
        if constexpr (kVnniPanels)
          for (int r = 0; r < R; ++r) sum[r] = _mm256_add_epi32(sum[r], scaled_sums(part[r], scale));
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(d, _mm256_set1_ps(a.d[(m + r) * (K / 32) + 8 * s + j])),
                                 acc[r]);
    }
  }
}

// R rows of x quantized per 32 (from row m) against one panel of kQ4_0_Panels or kQ4_1_Panels: per block of
// 32 the 4 steps' products add up in int16 (<= 2 * 4 * 15 * 127), into int32 (vpmaddwd by ones) and to float
// with the columns' d times the rows' scales, plus the offsets (Q4_1's m, Q4_0's -8 d) times the rows' sums;
// `ahead` as Q4_K's (a block's 144 or 160 bytes over its 4 steps: under a line a step).
template <int R, int64_t Type>
__attribute__((noinline)) void block32_panel_tile(const uint8_t* panel, const QuantizedRows& a, int64_t m, __m256 acc[R],
                                                  const char* ahead, const char* ahead_end) {
  constexpr int64_t kBytes = panel_block_bytes(Type);
  const int64_t K = a.K;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const int8_t* x[R];
  const float *d[R], *s16[R];   // the rows' scales per 32 and d times their sums per 16
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    x[r] = a.q.data() + (m + r) * K;
    d[r] = a.d.data() + (m + r) * (K / 32);
    s16[r] = a.s16.data() + (m + r) * (K / 16);
  }
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* block = panel + b * kBytes;
    __m256i part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      ask_ahead(ahead, ahead_end);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * p));
      const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      add_pair<R>(part, lo, hi, x, 32 * b + 8 * p);
    }
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 128)));
    const __m256 offset = Type == kQ4_1_Panels
                              ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 144)))
                              : _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(summed(part[r])), _mm256_mul_ps(scale, _mm256_set1_ps(d[r][b])),
                               acc[r]);
      acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(s16[r][2 * b] + s16[r][2 * b + 1]), acc[r]);
    }
  }
}

// A panel of kQ5_K_Panels (K/256 super-blocks) decoded as q4k_panel_tile decodes it: per super-block and pair
// of steps, the low nibbles' and the high nibbles' 5-bit weights as 32 bytes each, [K/256][32][2][32].
inline void decode_q5k_panel(const uint8_t* panel, int64_t supers, uint8_t* out) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* block = panel + s * kQ5KPanelBytes;
    for (int j = 0; j < 8; ++j) {
      __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kQ4KPanelBytes + 32 * j));
      for (int p = 0; p < 4; ++p) {
        if (p == 2) high = _mm256_slli_epi16(high, 4);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * (4 * j + p)));
        __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        or_fifth_bits(high, p, lo, hi);
        __m256i* o = reinterpret_cast<__m256i*>(out + 2048 * s + 64 * (4 * j + p));
        _mm256_storeu_si256(o, lo);
        _mm256_storeu_si256(o + 1, hi);
      }
    }
  }
}

// Panels [begin, end) of one part in panels (blocks: its panels; Type a panel type) for every row of a, in
// tiles of kPanelRows rows; the first tile of each panel asks for the next one.
template <int64_t Type, typename T>
inline void part_panels(const uint8_t* blocks, int64_t begin, int64_t end, const QuantizedRows& a, int64_t M, T* y,
                        int64_t ldy, int64_t col0) {
  const int64_t panel_bytes = a.K / part_format(Type).block * panel_block_bytes(Type);
  thread_local std::vector<uint8_t> decoded;   // Q5_K from quant_q5k_decoded_rows rows
  const bool decode = Type == kQ5_K_Panels && M >= quant_q5k_decoded_rows.load(std::memory_order_relaxed);
  if (decode) decoded.resize(a.K / 256 * 2048);
  for (int64_t i = begin; i < end; ++i) {
    const uint8_t* panel = blocks + i * panel_bytes;
    const char* next = reinterpret_cast<const char*>(panel + panel_bytes);
    if (decode) decode_q5k_panel(panel, a.K / 256, decoded.data());
    for (int64_t m = 0; m < M; m += kPanelRows) {
      __m256 acc[kPanelRows];
      const int64_t rows = std::min<int64_t>(kPanelRows, M - m);
      const char* ahead_end = m == 0 && i + 1 < end ? next + panel_bytes : next;
      with_rows<kPanelRows>(int(rows), [&](auto R) {
        if constexpr (Type == kQ4_K_Panels || Type == kQ5_K_Panels)
          if constexpr (Type == kQ4_K_Panels) q4k_panel_tile<decltype(R)::value, kNoFifth>(panel, a, m, acc, next, ahead_end, nullptr);
          else if (decode) q4k_panel_tile<decltype(R)::value, kFifthDecoded>(panel, a, m, acc, next, ahead_end, decoded.data());
          else q4k_panel_tile<decltype(R)::value, kFifthInRegisters>(panel, a, m, acc, next, ahead_end, nullptr);
        else if constexpr (Type == kQ6_K_Panels) q6k_panel_tile<decltype(R)::value>(panel, a, m, acc, next, ahead_end);
        else block32_panel_tile<decltype(R)::value, Type>(panel, a, m, acc, next, ahead_end);
      });
      for (int64_t r = 0; r < rows; ++r) {
        T* out = y + (m + r) * ldy + col0 + 8 * i;
        if constexpr (std::is_same_v<T, float>) {
          _mm256_storeu_ps(reinterpret_cast<float*>(out), acc[r]);
        } else {
          float v[kPanel];
          _mm256_storeu_ps(v, acc[r]);
          for (int n = 0; n < kPanel; ++n) out[n] = from_float<T>(v[n]);
        }
      }
    }
  }
}

#else
#define ASYNCSERVE_QUANT_PANEL 0
#endif

}  // namespace asyncserve

#include "quant_amx.h"

namespace asyncserve {

struct QuantPart {
  const uint8_t* blocks;   // [out, row_bytes]
  int64_t type, out, row_bytes, col0;
};

// y[:, part.col0 + n] = x . W_part[n] for every part's columns; x: [M, K] (ldx apart), y: [M, ldy].
template <typename T>
inline void quant_linear(const T* x, int64_t ldx, int64_t M, int64_t K, const std::vector<QuantPart>& parts, T* y,
                         int64_t ldy) {
  thread_local QuantizedRows a;   // kept between calls, like gemm.h's row tiles
  const bool int8 = quant_int8_on.load(std::memory_order_relaxed);
  bool per32 = false, per256 = false;   // which quantizations of x the parts in blocks take
  bool in_panels = false, panels32 = false, panels256 = false;   // and the parts in panels (int8 always)
  std::vector<QuantPart> rest;   // the parts in GGUF's own blocks
  for (const QuantPart& p : parts) {
    if (panel_type(p.type)) {
      in_panels = true;
      (p.type == kQ4_K_Panels || p.type == kQ5_K_Panels ? panels256 : panels32) = true;
      continue;
    }
    rest.push_back(p);
    (p.type == kQ4_K || p.type == kQ5_K ? per256 : per32) = true;
  }
  a.K = K;
  if (!int8) float_rows(x, ldx, M, K, a);
  if ((int8 && per32) || panels32) quantize_rows(x, ldx, M, K, 32, a);
  if ((int8 && per256) || panels256) quantize_rows(x, ldx, M, K, 256, a);
  const QuantizedRows& rows = a;  // the calling thread's buffer, not the pool threads' own
#if ASYNCSERVE_QUANT_PANEL
  if (in_panels) {   // int8 whatever set_quant_int8 says: panels have no other kernel
    // Q4_K, Q5_K and Q6_K on AMX tiles: units of two panels, over x's rows padded to whole tiles of 16
    const bool amx = quant_amx_runs(M);
    const int64_t padded = (M + 15) / 16 * 16 * K;
    if (amx && panels32 && int64_t(a.q.size()) < padded) a.q.resize(padded);
    if (amx && panels256 && int64_t(a.q256.size()) < padded) a.q256.resize(padded);
    const auto units_of = [&](const QuantPart& p) {   // a part's units of work: panels, or AMX's pairs of them
      return amx && amx_panel_type(p.type) ? (p.out / kPanel + 1) / 2 : p.out / kPanel;
    };
    int64_t units = 0;
    for (const QuantPart& p : parts) units += panel_type(p.type) ? units_of(p) : 0;
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      int64_t first = 0;
      for (const QuantPart& p : parts) {
        if (!panel_type(p.type)) continue;
        const int64_t count = units_of(p);
        const int64_t b = std::max<int64_t>(begin - first, 0), e = std::min<int64_t>(end - first, count);
#if ASYNCSERVE_QUANT_AMX
        if (b < e && amx && amx_panel_type(p.type)) {
          if (p.type == kQ4_K_Panels) amx_part_panels<kQ4_K_Panels>(p.blocks, p.out / kPanel, b, e, rows, M, y, ldy, p.col0);
          else if (p.type == kQ5_K_Panels) amx_part_panels<kQ5_K_Panels>(p.blocks, p.out / kPanel, b, e, rows, M, y, ldy, p.col0);
          else if (M >= kQ6kChunksFromRows) amx_part_panels<kQ6_K_Chunks>(p.blocks, p.out / kPanel, b, e, rows, M, y, ldy, p.col0);
          else amx_part_panels<kQ6_K_Panels>(p.blocks, p.out / kPanel, b, e, rows, M, y, ldy, p.col0);
          first += count;
          continue;
        }
#endif
        if (b < e && p.type == kQ4_0_Panels) part_panels<kQ4_0_Panels>(p.blocks, b, e, rows, M, y, ldy, p.col0);
        if (b < e && p.type == kQ4_1_Panels) part_panels<kQ4_1_Panels>(p.blocks, b, e, rows, M, y, ldy, p.col0);
        if (b < e && p.type == kQ4_K_Panels) part_panels<kQ4_K_Panels>(p.blocks, b, e, rows, M, y, ldy, p.col0);
        if (b < e && p.type == kQ5_K_Panels) part_panels<kQ5_K_Panels>(p.blocks, b, e, rows, M, y, ldy, p.col0);
        if (b < e && p.type == kQ6_K_Panels) part_panels<kQ6_K_Panels>(p.blocks, b, e, rows, M, y, ldy, p.col0);
        first += count;
      }
    });
  }
#endif
  if (rest.empty()) return;
#if ASYNCSERVE_QUANT_PANEL
  if (int8 && M >= quant_panel_rows.load(std::memory_order_relaxed)) {
    int64_t panels = 0;
    for (const QuantPart& p : rest) panels += (p.out + kPanel - 1) / kPanel;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      thread_local Panel panel;
      panel.resize(K);
      int64_t first = 0;
      for (const QuantPart& p : rest) {
        const int64_t count = (p.out + kPanel - 1) / kPanel;
        const int64_t last = std::min<int64_t>(end - first, count);
        for (int64_t i = std::max<int64_t>(begin - first, 0); i < last; ++i) {
          const int64_t n0 = kPanel * i;
          const int valid = int(std::min<int64_t>(kPanel, p.out - n0));
          const char* next = reinterpret_cast<const char*>(p.blocks + (n0 + kPanel) * p.row_bytes);
          const PanelAhead ahead{next, i + 1 < last ? next + std::min<int64_t>(kPanel, p.out - n0 - kPanel) * p.row_bytes : next};
          switch (p.type) {
#define ASYNCSERVE_QUANT_CASE(TYPE) \
  case TYPE: quant_panel<TYPE, T>(p.blocks, p.row_bytes, n0, valid, rows, M, y, ldy, p.col0, panel, ahead); break;
            ASYNCSERVE_QUANT_CASE(kQ4_0) ASYNCSERVE_QUANT_CASE(kQ4_1) ASYNCSERVE_QUANT_CASE(kQ8_0)
            ASYNCSERVE_QUANT_CASE(kQ4_K) ASYNCSERVE_QUANT_CASE(kQ5_K) ASYNCSERVE_QUANT_CASE(kQ6_K)
#undef ASYNCSERVE_QUANT_CASE
          }
        }
        first += count;
      }
    });
    return;
  }
#endif
  int64_t total = 0;
  for (const QuantPart& p : rest) total += p.out;
  at::parallel_for(0, total, 8, [&](int64_t begin, int64_t end) {
    thread_local DecodedColumn c;
    c.resize(K, !int8);
    int64_t first = 0;
    for (const QuantPart& p : rest) {
      const int64_t n0 = std::max<int64_t>(begin - first, 0), n1 = std::min<int64_t>(end - first, p.out);
      first += p.out;
      if (n0 >= n1) continue;
      switch (p.type) {
#define ASYNCSERVE_QUANT_CASE(TYPE) \
  case TYPE: quant_columns<TYPE, T>(p.blocks, p.row_bytes, n0, n1, rows, M, y, ldy, p.col0, c, int8); break;
        ASYNCSERVE_QUANT_CASE(kQ4_0) ASYNCSERVE_QUANT_CASE(kQ4_1) ASYNCSERVE_QUANT_CASE(kQ8_0)
        ASYNCSERVE_QUANT_CASE(kQ4_K) ASYNCSERVE_QUANT_CASE(kQ5_K) ASYNCSERVE_QUANT_CASE(kQ6_K)
#undef ASYNCSERVE_QUANT_CASE
      }
    }
  });
}

// Column n of a weight in panels of Type (panels: all of its [N/8][K/256][bytes]), decoded as decode_column
// decodes the same column's GGUF blocks: the same q, scales and offsets, so the same dequantized bits.
template <int64_t Type>
inline void decode_panel_column(const uint8_t* panels, int64_t n, int64_t K, DecodedColumn& c) {
  constexpr int64_t kBytes = panel_block_bytes(Type), kBlock = part_format(Type).block;
  const int64_t count = K / kBlock, col = n % 8;
  for (int64_t s = 0; s < count; ++s) {
    const uint8_t* src = panels + (n / 8 * count + s) * kBytes;
    uint8_t* q = c.q.data() + kBlock * s;
    float* scale = c.scale.data() + kBlock / 16 * s;
    float* offset = c.offset.data() + kBlock / 16 * s;
    panel_values(src, int(col), int(kBlock / 32), Type == kQ6_K_Panels, q);
    if constexpr (Type == kQ4_0_Panels || Type == kQ4_1_Panels) {
      const float d = half_to_float(src + 128 + 2 * col);
      scale[0] = scale[1] = d;
      offset[0] = offset[1] = Type == kQ4_1_Panels ? half_to_float(src + 144 + 2 * col) : -8.0f * d;
    } else if constexpr (Type == kQ4_K_Panels || Type == kQ5_K_Panels) {
      if constexpr (Type == kQ5_K_Panels)
        for (int j = 0; j < 8; ++j)
          for (int p = 0; p < 4; ++p)
            for (int i = 0; i < 4; ++i) {
              const uint8_t bits = src[kQ4KPanelBytes + 32 * j + 4 * col + i];
              q[32 * j + 8 * p + i] |= uint8_t(((bits >> five_bit(p, 0)) & 1) << 4);
              q[32 * j + 8 * p + 4 + i] |= uint8_t(((bits >> five_bit(p, 1)) & 1) << 4);
            }
      const float d = half_to_float(src + 1152 + 2 * col), dmin = half_to_float(src + 1168 + 2 * col);
      for (int j = 0; j < 8; ++j) {
        scale[2 * j] = scale[2 * j + 1] = d * float(src[1024 + 8 * j + col]);
        offset[2 * j] = offset[2 * j + 1] = -dmin * float(src[1088 + 16 * (j / 2) + 2 * col + j % 2]);
      }
    } else {
      const float d = half_to_float(src + 1664 + 2 * col);
      for (int g = 0; g < 16; ++g) {
        scale[g] = d * float(int8_t(src[1536 + 16 * (g / 2) + 2 * col + g % 2]));
        offset[g] = -32.0f * scale[g];
      }
    }
  }
}

// Rows ids of one weight's blocks, dequantized: out [n, K] (an embedding table kept in blocks: a lookup
// decodes only the rows it gathers). w = scale q + offset with one fp32 FMA: gguf's dequantization
// exactly for Q4_0, Q8_0 and Q6_K; for Q4_1, Q4_K and Q5_K within the one rounding gguf's two-step
// d q + m adds.
template <typename T>
inline void quant_rows(const uint8_t* blocks, int64_t type, int64_t row_bytes, int64_t K, const int64_t* ids,
                       int64_t n, T* out) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    thread_local DecodedColumn c;
    c.resize(K, true);
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = blocks + ids[i] * row_bytes;
      switch (type) {
        case kQ4_0_Panels: decode_panel_column<kQ4_0_Panels>(blocks, ids[i], K, c); dequantize_column<false>(c, K); break;
        case kQ4_1_Panels: decode_panel_column<kQ4_1_Panels>(blocks, ids[i], K, c); dequantize_column<false>(c, K); break;
        case kQ4_K_Panels: decode_panel_column<kQ4_K_Panels>(blocks, ids[i], K, c); dequantize_column<false>(c, K); break;
        case kQ5_K_Panels: decode_panel_column<kQ5_K_Panels>(blocks, ids[i], K, c); dequantize_column<false>(c, K); break;
        case kQ6_K_Panels: decode_panel_column<kQ6_K_Panels>(blocks, ids[i], K, c); dequantize_column<false>(c, K); break;
#define ASYNCSERVE_QUANT_CASE(TYPE) \
  case TYPE: decode_column<TYPE>(row, K, c); dequantize_column<TYPE == kQ8_0>(c, K); break;
        ASYNCSERVE_QUANT_CASE(kQ4_0) ASYNCSERVE_QUANT_CASE(kQ4_1) ASYNCSERVE_QUANT_CASE(kQ8_0)
        ASYNCSERVE_QUANT_CASE(kQ4_K) ASYNCSERVE_QUANT_CASE(kQ5_K) ASYNCSERVE_QUANT_CASE(kQ6_K)
#undef ASYNCSERVE_QUANT_CASE
      }
      for (int64_t k = 0; k < K; ++k) out[i * K + k] = from_float<T>(c.w[k]);
    }
  });
}

}  // namespace asyncserve
