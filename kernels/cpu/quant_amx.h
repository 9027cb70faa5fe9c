// quant_linear's Q4_K, Q5_K and Q6_K panels (kQ4_K_Panels ..) on AMX's int8 tiles, where the CPU has
// them (Sapphire Rapids and later) and a call has quant_amx_rows rows or more (a decode step of many
// streams, a prefill).
//
// A tile product multiplies 16 rows of x's int8 activations (A, read where quantize_rows left them) by
// 16 columns of weights (B: two neighbouring panels of 8), 256 row-column dot products at once. Vector
// 4j + p of a panel is already 8 columns x 4 consecutive weights, the layout B takes, so its nibbles
// become B's rows with an and (and a shift) per 64 bytes, written to a small ring in L1 one
// super-block ahead of the products that load them.
//
// The cost is not the products (a 16 x 16 x 64 product every ~4.5 ns here) but storing C and scaling
// it in AVX-512, once per group of weights with its own scale. So Q4_K's and Q5_K's 6-bit chunk scales go
// into B (kquant_chunk_b): a super-block's 256 weights add up in two tiles and are stored once, not per
// chunk.
// Q6_K's int8 scales times 6-bit weights do not fit a byte: its products (signed weights, TDPBSSD) are
// stored per group of 16 and scaled as q6k_panel_tile scales them; from kQ6kChunksFromRows rows, each weight
// times its scale is split as 64 hi + lo into two B tiles, stored per chunk of 32 (its rows' scale's span).
//
// Each sums the same integers as the vpdpbusd tiles (q4k_panel_tile, q6k_panel_tile) and folds them to
// float with the same operations per column: the same bits (test_quant_kernels' AMX tests).
#pragma once

#if ASYNCSERVE_QUANT_PANEL && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__)
#define ASYNCSERVE_QUANT_AMX 1
#else
#define ASYNCSERVE_QUANT_AMX 0
#endif

namespace asyncserve {

// Rows from which quant_linear runs Q4_K, Q5_K and Q6_K panels on AMX tiles where it can (quant_amx_runs), read
// per call; set_quant_amx_rows changes it to compare the two. 12: on box G (Sapphire Rapids-class Xeon, 2
// threads, a 1B model's shapes, bf16 x) the tiles against vpdpbusd's: Q4_K 1.0-1.3x at 8 rows, 1.4-1.8x
// at 12, 1.8-2.3x at 16; Q6_K 0.7-0.8x at 8, about even at 12, 1.3x at 16.
inline std::atomic<int64_t> quant_amx_rows{12};

#if ASYNCSERVE_QUANT_AMX

// Whether Linux granted the process AMX's tile state (amx_permitted) and the call has the rows.
inline bool quant_amx_runs(int64_t M) { return M >= quant_amx_rows.load(std::memory_order_relaxed) && amx_permitted(); }

constexpr bool amx_panel_type(int64_t type) {
  return type == kQ4_K_Panels || type == kQ5_K_Panels || type == kQ6_K_Panels;
}

// Q6_K's panels (kQ6_K_Panels' bytes) on the tiles with each chunk's scales inside B (q6k_chunk_b), from
// kQ6kChunksFromRows rows; below, each group's products scaled as they are folded (q6k_group_b). Measured on box G
// (bench_quant.py, 2 threads, a 1B model's shapes, bf16 x), chunks against groups: 0.89-0.97x at 12-16 rows (writing
// B takes three times the work, once per 16 rows there), even at 24-48, 1.1x at 64, 1.2-1.26x at 256.
constexpr int64_t kQ6_K_Chunks = 0x200 + kQ6_K;
constexpr int64_t kQ6kChunksFromRows = 32;

// The bytes of Type's panels per super-block.
constexpr int64_t amx_block_bytes(int64_t type) { return panel_block_bytes(type == kQ6_K_Chunks ? kQ6_K_Panels : type); }

// Q4_K and Q5_K: their activations per 256, one fold per super-block (q4k_fold).
constexpr bool amx_super_type(int64_t type) { return type == kQ4_K_Panels || type == kQ5_K_Panels; }

constexpr int kAmxRows = 16;   // rows of x per tile product (and columns: two panels)

// tmm0-1 and tmm6-7: C, 16 rows x 16 int32 (two pairs: one super-block's or chunk's products start while
// the other's are stored); tmm2-3: A, 16 rows of k bytes of x; tmm4-5: B, k/4 rows of 16 columns x 4 weights.
struct alignas(64) QuantTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  explicit QuantTileConfig(int k) {
    for (int t : {0, 1, 6, 7}) colsb[t] = 64, rows[t] = kAmxRows;
    for (int t : {2, 3}) colsb[t] = uint16_t(k), rows[t] = kAmxRows;
    for (int t : {4, 5}) colsb[t] = 64, rows[t] = uint8_t(k / 4);
  }
};

// 32 bytes at a (columns 0-7) then 32 at b (columns 8-15).
inline __m512i two_panels(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// 8 bytes at a then 8 at b, widened to 16 int32.
inline __m512i two_panels_u8(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
}

// 16 bytes at a then 16 at b.
inline __m256i two_panels16(const uint8_t* a, const uint8_t* b) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
}

// 8 fp16 at a then 8 at b, as 16 floats.
inline __m512 two_panels_halves(const uint8_t* a, const uint8_t* b) { return _mm512_cvtph_ps(two_panels16(a, b)); }

// sum[r] += c's row r times scale (16 columns).
inline void add_scaled_rows(__m512i sum[kAmxRows], const int32_t* c, __m512i scale) {
  for (int r = 0; r < kAmxRows; ++r) sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(_mm512_load_si512(c + 16 * r), scale));
}

// The thread's next unit asked for into L2, `lines` lines per call, while any is left.
inline void ask_ahead_lines(const char*& ahead, const char* ahead_end, int lines) {
  for (int i = 0; i < lines; ++i) ask_ahead(ahead, ahead_end);
}

// Q4_K and Q5_K: each chunk's 6-bit scales go into B, so that a super-block's products add up in the tile and
// are stored once (not once per chunk, the tile store being what bounds the tiles): sc = 8 hi + lo (hi, lo < 8),
// and B_hi = q hi, B_lo = q lo (<= 31 * 7, unsigned bytes), whose sums give 8 C_hi + C_lo = the sum of sc times each chunk's
// products, the same integers as q4k_panel_tile's. Per super-block: 4 steps of 64 weights, each A (16 rows x
// 64 bytes of x) against B_hi and B_lo (16 rows: chunks 2i and 2i + 1).
//
// Chunk j of the super-block at a / b (two panels' kQ4_K_Panels or kQ5_K_Panels bytes) into stage [4 steps][hi,
// lo][16 rows][64]: row 2p of the chunk the low nibbles of vector 4j + p (its weights 8p..8p+3 of each column),
// 2p + 1 the high ones, Q5_K's fifth bits ored in at bit 4 (five_bit: a 16-bit shift and an and per pair
// take each byte's bit alone), each weight times its column's hi or lo (vpmullw: the low byte's product,
// <= 31 * 7, carries nothing into the high one).
template <bool Five>
inline void kquant_chunk_b(const uint8_t* a, const uint8_t* b, int j, uint8_t* stage) {
  const __m512i mask = _mm512_set1_epi8(0x0F), seven = _mm512_set1_epi16(7), one = _mm512_set1_epi8(1);
  const __m512i sc = two_panels_u8(a + 1024 + 8 * j, b + 1024 + 8 * j);   // column n's in lane n
  const __m512i sc16 = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));  // and in both its int16 halves
  const __m512i hi = _mm512_srli_epi16(sc16, 3), lo = _mm512_and_si512(sc16, seven);
  const __m512i fifth = Five ? two_panels(a + kQ4KPanelBytes + 32 * j, b + kQ4KPanelBytes + 32 * j) : _mm512_setzero_si512();
  uint8_t* rows = stage + 2048 * (j / 2) + 512 * (j % 2);
  for (int p = 0; p < 4; ++p) {
    const __m512i v = two_panels(a + 32 * (4 * j + p), b + 32 * (4 * j + p));
    __m512i q0 = _mm512_and_si512(v, mask), q1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    if constexpr (Five) {
      q0 = _mm512_or_si512(q0, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(fifth, five_bit(p, 0)), one), 4));
      q1 = _mm512_or_si512(q1, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(fifth, five_bit(p, 1)), one), 4));
    }
    _mm512_storeu_si512(rows + 128 * p, _mm512_mullo_epi16(q0, hi));
    _mm512_storeu_si512(rows + 128 * p + 64, _mm512_mullo_epi16(q1, hi));
    _mm512_storeu_si512(rows + 1024 + 128 * p, _mm512_mullo_epi16(q0, lo));
    _mm512_storeu_si512(rows + 1024 + 128 * p + 64, _mm512_mullo_epi16(q1, lo));
  }
}

// Group g = 2j + h (16 weights) of the super-block at a / b (kQ6_K_Panels) as B, signed (q - 32): rows 0 and 1
// the low and high nibbles' weights of pair 2h, rows 2 and 3 those of pair 2h + 1, each with its 2 high bits.
// Q6_K's scales stay out of B (an int8 times a 6-bit weight needs more than a byte): its products are stored
// per group.
inline void q6k_group_b(const uint8_t* a, const uint8_t* b, int j, int h, uint8_t* stage) {
  const __m512i mask = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(0x03), bias = _mm512_set1_epi8(32);
  const __m512i qh = two_panels(a + 1024 + 32 * (2 * j + h), b + 1024 + 32 * (2 * j + h));
  for (int half = 0; half < 2; ++half) {
    const int p = 2 * h + half;
    const __m512i v = two_panels(a + 32 * (4 * j + p), b + 32 * (4 * j + p));
    const __m512i lo = _mm512_or_si512(_mm512_and_si512(v, mask),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 4 * half), three), 4));
    const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), mask),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 4 * half + 2), three), 4));
    _mm512_storeu_si512(stage + 128 * half, _mm512_sub_epi8(lo, bias));
    _mm512_storeu_si512(stage + 128 * half + 64, _mm512_sub_epi8(hi, bias));
  }
}

// Chunk j (32 weights, groups 2j and 2j + 1) of the super-block at a / b (kQ6_K_Panels) as two B tiles of 8 rows, hi
// and lo: each weight times its group's int8 scale, w = sc (q - 32) in [-4064, 4096], split as 64 hi + lo (hi in
// [-64, 64], lo in [0, 63]: signed bytes both), so that a chunk's two groups add up in one pair of tiles whose sum
// 64 C_hi + C_lo is q6k_panel_tile's integer for the chunk. Rows 4h .. 4h + 3 are group 2j + h's: the low and high
// nibbles' weights of pair 2h, then of pair 2h + 1, each with its 2 high bits.
inline void q6k_chunk_b(const uint8_t* a, const uint8_t* b, int j, uint8_t* stage) {
  const __m512i mask = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(0x03), bias = _mm512_set1_epi8(32);
  const __m512i low6 = _mm512_set1_epi16(63), low_byte = _mm512_set1_epi16(0xFF);
  // the scales of groups 2j, 2j + 1 per column (bytes [n][2] per panel)
  const __m128i sa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 1536 + 16 * j));
  const __m128i sb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1536 + 16 * j));
  for (int h = 0; h < 2; ++h) {
    // group 2j + h's scale of column n in int16 lanes 2n and 2n + 1 (a B row's 4 bytes of the column)
    const __m128i pick = _mm_setr_epi8(h, h, 2 + h, 2 + h, 4 + h, 4 + h, 6 + h, 6 + h, 8 + h, 8 + h, 10 + h, 10 + h, 12 + h,
                                       12 + h, 14 + h, 14 + h);
    const __m512i scale = _mm512_cvtepi8_epi16(_mm256_setr_m128i(_mm_shuffle_epi8(sa, pick), _mm_shuffle_epi8(sb, pick)));
    const __m512i qh = two_panels(a + 1024 + 32 * (2 * j + h), b + 1024 + 32 * (2 * j + h));
    for (int half = 0; half < 2; ++half) {
      const int p = 2 * h + half;
      const __m512i v = two_panels(a + 32 * (4 * j + p), b + 32 * (4 * j + p));
      const __m512i nibbles[2] = {
          _mm512_or_si512(_mm512_and_si512(v, mask),
                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 4 * half), three), 4)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), mask),
                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 4 * half + 2), three), 4))};
      for (int n = 0; n < 2; ++n) {
        const __m512i q = _mm512_sub_epi8(nibbles[n], bias);
        // the even and odd bytes as int16 (sign-extended) times their column's scale
        const __m512i even = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(q, 8), 8), scale);
        const __m512i odd = _mm512_mullo_epi16(_mm512_srai_epi16(q, 8), scale);
        const int row = 4 * h + 2 * half + n;
        _mm512_storeu_si512(stage + 64 * row, _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(even, 6), low_byte),
                                                              _mm512_slli_epi16(_mm512_srai_epi16(odd, 6), 8)));
        _mm512_storeu_si512(stage + 512 + 64 * row, _mm512_or_si512(_mm512_and_si512(even, low6),
                                                                    _mm512_slli_epi16(_mm512_and_si512(odd, low6), 8)));
      }
    }
  }
}

// Super-block s of a unit as B tiles into stage, 8 KiB: Q4_K's and Q5_K's [4][2][16][64]; Q6_K's 16 groups of [4][64], as
// 16 of 512 bytes (the second half unused), or its 8 chunks' [2][8][64].
template <int64_t Type>
inline void stage_super(const uint8_t* a, const uint8_t* b, uint8_t* stage) {
  for (int j = 0; j < 8; ++j) {
    if constexpr (amx_super_type(Type)) {
      kquant_chunk_b<Type == kQ5_K_Panels>(a, b, j, stage);
    } else if constexpr (Type == kQ6_K_Chunks) {
      q6k_chunk_b(a, b, j, stage + 1024 * j);
    } else {
      q6k_group_b(a, b, j, 0, stage + 1024 * j);
      q6k_group_b(a, b, j, 1, stage + 1024 * j + 512);
    }
  }
}

// (gcc's tile intrinsics take the tile numbers as literals: Pair 0 runs on C tiles 0 and 1, pair 1 on 6 and 7.)
#define ASYNCSERVE_Q4K_PRODUCTS(HI, LO)                               \
  _tile_zero(HI);                                                     \
  _tile_zero(LO);                                                     \
  for (int i = 0; i < 4; ++i) {                                       \
    _tile_loadd(2, xs + 64 * i, K);                                   \
    _tile_loadd(4, stage + 2048 * i, 64);                             \
    _tile_loadd(5, stage + 2048 * i + 1024, 64);                      \
    _tile_dpbsud(HI, 2, 4);                                           \
    _tile_dpbsud(LO, 2, 5);                                           \
  }                                                                   \
  _tile_stored(HI, c, 64);                                            \
  _tile_stored(LO, c + 256, 64);

// Q6_K's chunk j: A2 the tile holding the second product's x, 3 in groups (x's second 16 bytes, kQ6_K_Panels), 2 in
// chunks (one load of 32 bytes against B_hi and B_lo, kQ6_K_Chunks).
#define ASYNCSERVE_Q6K_PRODUCTS(C0, C1, A2)                           \
  _tile_loadd(2, xs + 32 * j, K);                                     \
  if constexpr (A2 == 3) _tile_loadd(3, xs + 32 * j + 16, K);         \
  _tile_loadd(4, stage + 1024 * j, 64);                               \
  _tile_loadd(5, stage + 1024 * j + 512, 64);                         \
  _tile_zero(C0);                                                     \
  _tile_zero(C1);                                                     \
  _tile_dpbssd(C0, 2, 4);                                             \
  _tile_dpbssd(C1, A2, 5);                                            \
  _tile_stored(C0, c, 64);                                            \
  _tile_stored(C1, c + 256, 64);

// The products run in steps, each stored into c [2][16][16] and folded while the next step's run: Q4_K's one
// (and Q5_K's) per super-block (C_hi, C_lo), Q6_K's one per chunk j of 32 (groups 2j and 2j + 1, or C_hi and C_lo),
// kSteps per super-block.
template <int64_t Type>
constexpr int kSteps = amx_super_type(Type) ? 1 : 8;

// Step j's products for 16 rows of x from xs (its super-block's, K apart), stage the super-block's B.
template <int64_t Type, int Pair>
inline void step_products(const uint8_t* stage, const int8_t* xs, int64_t K, int j, int32_t* c) {
  if constexpr (amx_super_type(Type)) {
    if constexpr (Pair == 0) {
      ASYNCSERVE_Q4K_PRODUCTS(0, 1)
    } else {
      ASYNCSERVE_Q4K_PRODUCTS(6, 7)
    }
  } else if constexpr (Type == kQ6_K_Chunks) {
    if constexpr (Pair == 0) {
      ASYNCSERVE_Q6K_PRODUCTS(0, 1, 2)
    } else {
      ASYNCSERVE_Q6K_PRODUCTS(6, 7, 2)
    }
  } else {
    if constexpr (Pair == 0) {
      ASYNCSERVE_Q6K_PRODUCTS(0, 1, 3)
    } else {
      ASYNCSERVE_Q6K_PRODUCTS(6, 7, 3)
    }
  }
}
#undef ASYNCSERVE_Q4K_PRODUCTS
#undef ASYNCSERVE_Q6K_PRODUCTS

// acc [16][16] += super-block s of rows m.. (rows of them x's) from its products c (C_hi, C_lo): fold_super per
// column lane; a / b the two panels' super-block.
inline void q4k_fold(const uint8_t* a, const uint8_t* b, const int32_t* c, const QuantizedRows& x, int64_t m,
                     int rows, int64_t s, float* acc) {
  const int64_t K = x.K, supers = K / 256;
  __m512i mn[4];   // the mins of chunk pairs (16 bytes [n][2] per panel)
  for (int i = 0; i < 4; ++i) mn[i] = _mm512_cvtepu8_epi16(two_panels16(a + 1088 + 16 * i, b + 1088 + 16 * i));
  const __m512 d = two_panels_halves(a + 1152, b + 1152), dmin = two_panels_halves(a + 1168, b + 1168);
  for (int r = 0; r < rows; ++r) {
    const int16_t* sums = x.sum32.data() + (m + r) * (K / 32) + 8 * s;
    __m512i mins = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      int32_t pair;
      std::memcpy(&pair, sums + 2 * i, 4);
      mins = _mm512_add_epi32(mins, _mm512_madd_epi16(_mm512_set1_epi32(pair), mn[i]));
    }
    const __m512 dx = _mm512_set1_ps(x.d256[(m + r) * supers + s]);
    const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c + 16 * r), 3), _mm512_load_si512(c + 256 + 16 * r));
    __m512 row = _mm512_loadu_ps(acc + 16 * r);
    row = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, dx), row);
    _mm512_storeu_ps(acc + 16 * r, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, dx), row));
  }
}

// The same for Q6_K's chunk j: q6k_panel_tile's sums (its offsets -32 sc sum(x) are in the signed weights here),
// each group's products times its int8 scale, folded with the rows' scales of the chunk.
inline void q6k_fold(const uint8_t* a, const uint8_t* b, const int32_t* c, const QuantizedRows& x, int64_t m,
                     int rows, int64_t s, int j, float* acc) {
  const int64_t K = x.K;
  const __m512 d = two_panels_halves(a + 1664, b + 1664);
  // groups 2j and 2j + 1's int8 scales: int16 lanes 2n and 2n + 1 of int32 lane n
  const __m512i scales = _mm512_cvtepi8_epi16(two_panels16(a + 1536 + 16 * j, b + 1536 + 16 * j));
  __m512i sum[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) sum[r] = _mm512_setzero_si512();
  add_scaled_rows(sum, c, _mm512_srai_epi32(_mm512_slli_epi32(scales, 16), 16));
  add_scaled_rows(sum, c + 256, _mm512_srai_epi32(scales, 16));
  for (int r = 0; r < rows; ++r) {
    const __m512 dx = _mm512_set1_ps(x.d[(m + r) * (K / 32) + 8 * s + j]);
    _mm512_storeu_ps(acc + 16 * r, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(d, dx),
                                                  _mm512_loadu_ps(acc + 16 * r)));
  }
}

// The same for Q6_K's chunk j in chunks (kQ6_K_Chunks): q6k_panel_tile's integer (its offsets -32 sc sum(x) are in the
// signed weights here, its scales in B: 64 C_hi + C_lo), folded with the rows' scales of the chunk.
inline void q6k_chunk_fold(const uint8_t* a, const uint8_t* b, const int32_t* c, const QuantizedRows& x, int64_t m,
                           int rows, int64_t s, int j, float* acc) {
  const int64_t K = x.K;
  const __m512 d = two_panels_halves(a + 1664, b + 1664);
  for (int r = 0; r < rows; ++r) {
    const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c + 16 * r), 6), _mm512_load_si512(c + 256 + 16 * r));
    const __m512 dx = _mm512_set1_ps(x.d[(m + r) * (K / 32) + 8 * s + j]);
    _mm512_storeu_ps(acc + 16 * r, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, dx),
                                                  _mm512_loadu_ps(acc + 16 * r)));
  }
}

// Units [begin, end) of one part in panels of Type (amx_panel_type; unit u: panels 2u and
// 2u + 1, or the last panel alone) for every row of x in tiles of 16; x's row buffers hold whole tiles
// (quant_linear pads them). Per super-block s of a unit, its B is written once for all the row tiles, while
// s - 1's products run (a tile load of bytes just stored waits for them to retire; a ring of two stays in
// L1), and each step's products are folded while the next step's run. The unit asks for the thread's next
// one into L2 as it goes.
template <int64_t Type, typename T>
inline void amx_part_panels(const uint8_t* blocks, int64_t panels, int64_t begin, int64_t end, const QuantizedRows& x,
                            int64_t M, T* y, int64_t ldy, int64_t col0) {
  constexpr int64_t kBytes = amx_block_bytes(Type);
  constexpr int kLines = int(2 * kBytes + 63) / 64;   // a unit's lines per super-block
  const int64_t K = x.K, supers = K / 256, panel_bytes = supers * kBytes, tiles = (M + kAmxRows - 1) / kAmxRows;
  const int8_t* xq = amx_super_type(Type) ? x.q256.data() : x.q.data();
  alignas(64) uint8_t stage[2][8192];   // on the stack: a thread_local costs a call to find it, each time
  alignas(64) int32_t c[2][2 * 256];     // a step's products, two in flight
  thread_local LineVector<float> kept_acc;   // kept between calls
  LineVector<float>& acc = kept_acc;          // [tiles][16 rows][16 columns] (its thread-local address found once)
  const QuantTileConfig config(amx_super_type(Type) ? 64 : Type == kQ6_K_Chunks ? 32 : 16);
  _tile_loadconfig(&config);
  for (int64_t u = begin; u < end; ++u) {
    const int64_t first = 2 * u, count = std::min<int64_t>(2, panels - first);
    const uint8_t* a = blocks + first * panel_bytes;
    const uint8_t* b = a + (count - 1) * panel_bytes;   // a lone last panel twice (its copy's columns unused)
    const char* ahead = reinterpret_cast<const char*>(a + 2 * panel_bytes);
    const char* ahead_end = u + 1 < end ? ahead + std::min<int64_t>(2, panels - first - 2) * panel_bytes : ahead;
    acc.assign(tiles * kAmxRows * 16, 0.0f);
    struct Step { int64_t s, tile; int j; };
    const auto fold = [&](const Step& done, const int32_t* products) {
      const int64_t m = kAmxRows * done.tile;
      const int rows = int(std::min<int64_t>(kAmxRows, M - m));
      float* tile_acc = acc.data() + done.tile * kAmxRows * 16;
      const int64_t at = done.s * kBytes;
      if constexpr (amx_super_type(Type)) q4k_fold(a + at, b + at, products, x, m, rows, done.s, tile_acc);
      else if constexpr (Type == kQ6_K_Chunks) q6k_chunk_fold(a + at, b + at, products, x, m, rows, done.s, done.j, tile_acc);
      else q6k_fold(a + at, b + at, products, x, m, rows, done.s, done.j, tile_acc);
    };
    int64_t step = 0;   // steps issued; each is folded once the next one is issued
    Step last{};
    stage_super<Type>(a, b, stage[0]);
    for (int64_t s = 0; s < supers; ++s) {
      if (s + 1 < supers) stage_super<Type>(a + (s + 1) * kBytes, b + (s + 1) * kBytes, stage[(s + 1) & 1]);
      for (int64_t t = 0; t < tiles; ++t)
        for (int j = 0; j < kSteps<Type>; ++j) {
          const int8_t* xs = xq + kAmxRows * t * K + 256 * s;
          if (step % 2 == 0) step_products<Type, 0>(stage[s & 1], xs, K, j, c[0]);
          else step_products<Type, 1>(stage[s & 1], xs, K, j, c[1]);
          if (t == 0 && j == 0) ask_ahead_lines(ahead, ahead_end, kLines);
          if (step > 0) fold(last, c[(step - 1) & 1]);
          last = {s, t, j};
          ++step;
        }
    }
    fold(last, c[(step - 1) & 1]);
    for (int64_t r = 0; r < M; ++r) {
      T* out = y + r * ldy + col0 + 8 * first;
      for (int n = 0; n < 8 * count; ++n) out[n] = from_float<T>(acc[16 * r + n]);
    }
  }
  _tile_release();
}

#else

inline bool quant_amx_runs(int64_t) { return false; }
constexpr bool amx_panel_type(int64_t) { return false; }

#endif

}  // namespace asyncserve
