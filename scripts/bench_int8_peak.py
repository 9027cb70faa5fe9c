"""The CPU's peak rate of the instructions the quantized kernels are made of, to read bench_quant.py's
GFLOP/s against: how far a kernel is from what the core can issue at all.

    .venv/bin/python scripts/bench_int8_peak.py            # one core, then all the process may use
    .venv/bin/python scripts/bench_int8_peak.py --seconds 2

Compiles a small C++ program with g++ -O3 -march=native (the kernels' flags) into a temporary folder
and runs it: per core, independent chains of

    maddubs+add   vpmaddubsw + vpaddw (AVX2's int8 dot product, 32 multiply-adds each), the inner
                  step of kernels/cpu/quant.h without VNNI
    vpdpbusd      (AVX-VNNI or AVX512-VNNI on 256 bits, where the CPU has it), 32 multiply-adds
    fp32 FMA      vfmadd on 8 lanes (oneDNN's and the attention kernels' instruction)

each in registers only (no loads: an upper bound), and prints multiply-adds per second per core and
for the threads together. A GEMM of M x K x N runs M * K * N multiply-adds; bench_quant.py prints
2 * that as GFLOP/s.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

// Runs `round` (register-only work of `madds` multiply-adds) until `seconds` pass: multiply-adds per second.
template <typename Round>
static double rate(double seconds, double madds, Round round) {
  long rounds = 0;
  const auto start = std::chrono::steady_clock::now();
  double elapsed = 0;
  while (elapsed < seconds) {
    for (int r = 0; r < 100000; ++r) round();
    rounds += 100000;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return rounds * madds / elapsed;
}

// Eight independent chains of `op` (32 multiply-adds of bytes each); the empty asm makes the inputs look
// changed each round, so nothing is hoisted out of the loop.
template <typename Op>
static double int8_chains(double seconds, Op op) {
  __m256i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_set1_epi32(i);
  __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(5), w2 = _mm256_set1_epi8(7), w3 = _mm256_set1_epi8(9);
  __m256i x0 = _mm256_set1_epi8(1), x1 = _mm256_set1_epi8(2);
  const double r = rate(seconds, 8 * 32, [&] {
    acc[0] = op(acc[0], w0, x0); acc[1] = op(acc[1], w1, x0); acc[2] = op(acc[2], w2, x0); acc[3] = op(acc[3], w3, x0);
    acc[4] = op(acc[4], w0, x1); acc[5] = op(acc[5], w1, x1); acc[6] = op(acc[6], w2, x1); acc[7] = op(acc[7], w3, x1);
    asm volatile("" : "+x"(w0), "+x"(w1), "+x"(w2), "+x"(w3), "+x"(x0), "+x"(x1));
  });
  int sink = 0;
  for (int i = 0; i < 8; ++i) sink += _mm256_extract_epi32(acc[i], 0);
  if (sink == 12345) std::puts("");
  return r;
}

static double maddubs_add(double seconds) {
  return int8_chains(seconds, [](__m256i a, __m256i w, __m256i x) { return _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x)); });
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI 1
static double dpbusd(double seconds) {
  return int8_chains(seconds, [](__m256i a, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(a, w, x); });
}
#elif defined(__AVXVNNI__)
#define HAVE_VNNI 1
static double dpbusd(double seconds) {
  return int8_chains(seconds, [](__m256i a, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(a, w, x); });
}
#else
#define HAVE_VNNI 0
static double dpbusd(double) { return 0; }
#endif

static double fma8(double seconds) {
  __m256 acc[10];
  for (int i = 0; i < 10; ++i) acc[i] = _mm256_set1_ps(float(i));
  __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  const double r = rate(seconds, 10 * 8, [&] {
#pragma GCC unroll 10
    for (int i = 0; i < 10; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    asm volatile("" : "+x"(a), "+x"(b));
  });
  float sink = 0;
  for (int i = 0; i < 10; ++i) sink += _mm256_cvtss_f32(acc[i]);
  if (sink == 12345.0f) std::puts("");
  return r;
}

// every thread runs `f` at once; the sum of their rates
static double together(double (*f)(double), int threads, double seconds) {
  std::vector<double> rates(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { rates[t] = f(seconds); });
  for (auto& t : pool) t.join();
  double sum = 0;
  for (double r : rates) sum += r;
  return sum;
}

int main(int argc, char** argv) {
  const double seconds = std::atof(argv[1]);
  const int threads = std::atoi(argv[2]);
  struct { const char* name; double (*f)(double); bool on; } tests[] = {
      {"maddubs+add (int8, AVX2)", maddubs_add, true},
      {"vpdpbusd (int8, VNNI)", dpbusd, HAVE_VNNI == 1},
      {"fp32 FMA (8 lanes)", fma8, true},
  };
  for (auto& t : tests) {
    if (!t.on) {
      std::printf("%-26s not in this CPU's build\n", t.name);
      continue;
    }
    const double one = t.f(seconds), all = together(t.f, threads, seconds);
    std::printf("%-26s %7.1f G multiply-adds/s on one core, %7.1f on %d threads (%.1f GFLOP/s)\n", t.name,
                one / 1e9, all / 1e9, threads, 2 * all / 1e9);
  }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1.0, help="per test and thread count")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for the second column (default: the CPUs this process may use)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O3", "-march=native", "-std=c++17", "-pthread", str(src), "-o", str(exe)], check=True)
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "unknown CPU")
        print(f"CPU: {model}; load average {os.getloadavg()[0]:.2f}")
        subprocess.run([str(exe), str(args.seconds), str(args.threads)], check=True)


if __name__ == "__main__":
    main()
