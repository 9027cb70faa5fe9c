// Scalar helpers that gcc vectorises at -O3 -march=native: bf16 <-> fp32 and exp on [-87, 0].
#pragma once

#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include <c10/util/BFloat16.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace asyncserve {

using bf16 = c10::BFloat16;

inline float to_float(float x) { return x; }

inline float to_float(bf16 x) {
  uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AMX_TILE__)
// Linux hands a process AMX's tile state only once asked (else the first tile instruction faults).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}
#endif

// The allocator of buffers read in whole cache lines (AMX tile loads, 64-byte vector loads and stores): their
// start on a line, where glibc's large blocks start 16 bytes into a page, and then every 64-byte row of them
// spans two lines (a tile load of such rows took 1.6x as long as of aligned ones, on box G).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
};

template <typename T>
using LineVector = std::vector<T, LineAligned<T>>;

template <typename T>
inline T from_float(float f);

template <>
inline float from_float<float>(float f) { return f; }

// Round to nearest even, as torch does; NaN stays a (quiet) NaN.
template <>
inline bf16 from_float<bf16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint16_t rounded = uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  return bf16(f != f ? uint16_t(0x7fc0) : rounded, bf16::from_bits());
}

// Asks for the cache lines of `bytes` bytes at `row` ahead of their use: rows the kernels follow
// through tables (pool pages, adapter rows) are scattered, so the hardware cannot guess them.
// Locality 3 brings them to L1 (for the next few hundred cycles), 2 to L2 (for later).
template <int Locality>
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, Locality);
}

// Bytes that a later kernel will read, handed to an earlier one to ask for as it goes (gemm.h's
// SideStream).
struct PrefetchSpan {
  const void* data;
  int64_t bytes;
};

// exp(x) for x <= 0 (softmax after subtracting the max), relative error ~1e-7. Plain arithmetic
// so that loops over it vectorise: Cody-Waite reduction x = n ln2 + y, |y| <= ln2/2, a degree-7
// Taylor polynomial for e^y, and 2^n built in the exponent bits. Below -87 it returns ~1.6e-38.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float round_magic = 12582912.0f;                  // 1.5 * 2^23: adding it rounds to an integer
  float n = (x * 1.44269504088896341f + round_magic) - round_magic;
  float y = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.0f / 5040;
  p = p * y + 1.0f / 720;
  p = p * y + 1.0f / 120;
  p = p * y + 1.0f / 24;
  p = p * y + 1.0f / 6;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  int32_t exponent = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent, 4);
  return p * scale;
}

// tanh(x), relative error ~3e-7, NaN stays NaN; plain arithmetic so that loops over it vectorise:
// tanh's odd Taylor polynomial below |x| = 1/4, (1 - e) / (1 + e) with e = exp(-2|x|) from there.
inline float tanh_float(float x) {
  const float a = x < 0.0f ? -x : x;
  const float e = exp_nonpositive(-2.0f * a);
  const float x2 = a * a;
  const float near =
      a * (1.0f + x2 * (-1.0f / 3 + x2 * (2.0f / 15 + x2 * (-17.0f / 315 + x2 * (62.0f / 2835)))));
  const float t = a < 0.25f ? near : (1.0f - e) / (1.0f + e);
  return x < 0.0f ? -t : t;
}

// Soft-capping of attention scores (Gemma 2): x -> tanh(x / cap) * cap, in place over n values.
inline void soft_cap(float* x, int64_t n, float cap) {
  const float inv = 1.0f / cap;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = cap * tanh_float(x[i] * inv);
}

#if defined(__AVX2__)
// The sum of v's 8 lanes.
inline float sum_lanes8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace asyncserve
