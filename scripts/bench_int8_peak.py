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

// Runs `rounds(n)` (n rounds of register-only work, `madds` multiply-adds each) until `seconds` pass:
// multiply-adds per second.
template <typename Rounds>
static double rate(double seconds, double madds, Rounds rounds) {
  long done = 0;
  const auto start = std::chrono::steady_clock::now();
  double elapsed = 0;
  while (elapsed < seconds) {
    rounds(100000);
    done += 100000;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return done * madds / elapsed;
}

// The rounds are written in assembly: eight (ten for FMA) independent chains, each accumulator in a
// register of its own (ymm6-15), the inputs in ymm0-5, nothing else in the loop. Written with intrinsics,
// gcc merged chains with equal inputs, or kept accumulators on the stack so that the store-to-load
// latency set the pace (this script's first version read 63 G/s on a Zen 3 core for the same instructions).
#define CHAIN8(OP)                                                                              \
  OP " %%ymm4, %%ymm0, %%ymm8\n\t" OP " %%ymm4, %%ymm1, %%ymm9\n\t" OP " %%ymm4, %%ymm2, %%ymm10\n\t" \
  OP " %%ymm4, %%ymm3, %%ymm11\n\t" OP " %%ymm5, %%ymm0, %%ymm12\n\t" OP " %%ymm5, %%ymm1, %%ymm13\n\t" \
  OP " %%ymm5, %%ymm2, %%ymm14\n\t" OP " %%ymm5, %%ymm3, %%ymm15\n\t"
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc"

// vpmaddubsw into a temporary, then vpaddw into its chain's sum: the two instructions of the AVX2 step.
static double maddubs_add(double seconds) {
  return rate(seconds, 8 * 32, [](long n) {
    asm volatile(
        "vpcmpeqb %%ymm0, %%ymm0, %%ymm0\n\tvpabsb %%ymm0, %%ymm1\n\tvmovdqa %%ymm1, %%ymm2\n\tvmovdqa %%ymm1, %%ymm3\n\t"
        "vmovdqa %%ymm1, %%ymm4\n\tvmovdqa %%ymm1, %%ymm5\n\t"
        "1:\n\t"
        "vpmaddubsw %%ymm4, %%ymm0, %%ymm6\n\tvpaddw %%ymm6, %%ymm8, %%ymm8\n\t"
        "vpmaddubsw %%ymm4, %%ymm1, %%ymm7\n\tvpaddw %%ymm7, %%ymm9, %%ymm9\n\t"
        "vpmaddubsw %%ymm4, %%ymm2, %%ymm6\n\tvpaddw %%ymm6, %%ymm10, %%ymm10\n\t"
        "vpmaddubsw %%ymm4, %%ymm3, %%ymm7\n\tvpaddw %%ymm7, %%ymm11, %%ymm11\n\t"
        "vpmaddubsw %%ymm5, %%ymm0, %%ymm6\n\tvpaddw %%ymm6, %%ymm12, %%ymm12\n\t"
        "vpmaddubsw %%ymm5, %%ymm1, %%ymm7\n\tvpaddw %%ymm7, %%ymm13, %%ymm13\n\t"
        "vpmaddubsw %%ymm5, %%ymm2, %%ymm6\n\tvpaddw %%ymm6, %%ymm14, %%ymm14\n\t"
        "vpmaddubsw %%ymm5, %%ymm3, %%ymm7\n\tvpaddw %%ymm7, %%ymm15, %%ymm15\n\t"
        "dec %0\n\tjnz 1b\n\tvzeroupper"
        : "+r"(n) : : CLOBBERS);
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI 1
#define DPBUSD "vpdpbusd"
#elif defined(__AVXVNNI__)
#define HAVE_VNNI 1
#define DPBUSD "{vex} vpdpbusd"
#else
#define HAVE_VNNI 0
#endif

#if HAVE_VNNI
static double dpbusd(double seconds) {
  return rate(seconds, 8 * 32, [](long n) {
    asm volatile("vpxor %%xmm0, %%xmm0, %%xmm0\n\tvpxor %%xmm1, %%xmm1, %%xmm1\n\tvpxor %%xmm2, %%xmm2, %%xmm2\n\t"
                 "vpxor %%xmm3, %%xmm3, %%xmm3\n\tvpxor %%xmm4, %%xmm4, %%xmm4\n\tvpxor %%xmm5, %%xmm5, %%xmm5\n\t"
                 "1:\n\t" CHAIN8(DPBUSD) "dec %0\n\tjnz 1b\n\tvzeroupper"
                 : "+r"(n) : : CLOBBERS);
  });
}
#else
static double dpbusd(double) { return 0; }
#endif

static double fma8(double seconds) {
  return rate(seconds, 10 * 8, [](long n) {
    asm volatile("vxorps %%xmm0, %%xmm0, %%xmm0\n\tvxorps %%xmm1, %%xmm1, %%xmm1\n\tvxorps %%xmm6, %%xmm6, %%xmm6\n\t"
                 "vxorps %%xmm7, %%xmm7, %%xmm7\n\t"
                 "1:\n\t"
                 "vfmadd231ps %%ymm0, %%ymm1, %%ymm6\n\tvfmadd231ps %%ymm0, %%ymm1, %%ymm7\n\t"
                 "vfmadd231ps %%ymm0, %%ymm1, %%ymm8\n\tvfmadd231ps %%ymm0, %%ymm1, %%ymm9\n\t"
                 "vfmadd231ps %%ymm0, %%ymm1, %%ymm10\n\tvfmadd231ps %%ymm0, %%ymm1, %%ymm11\n\t"
                 "vfmadd231ps %%ymm0, %%ymm1, %%ymm12\n\tvfmadd231ps %%ymm0, %%ymm1, %%ymm13\n\t"
                 "vfmadd231ps %%ymm0, %%ymm1, %%ymm14\n\tvfmadd231ps %%ymm0, %%ymm1, %%ymm15\n\t"
                 "dec %0\n\tjnz 1b\n\tvzeroupper"
                 : "+r"(n) : : CLOBBERS);
  });
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
