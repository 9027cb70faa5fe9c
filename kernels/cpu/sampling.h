// Greedy sampling over a step's logits as the model wrote them (bf16 or fp32), without the float32
// copy and the two-stage argmax that eager torch needs to be fast (~0.5 ms for 16 x 49,152 bf16
// logits on Zen 4 against ~40 us here).
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>

#include "common.h"

namespace asyncserve {

// logits: [rows, vocab] (row stride ld). tokens[r] = torch's argmax of row r: the first maximum,
// or the first NaN where the row has one (torch ranks NaN above everything); finite[r] = whether
// that logit is finite. Per row, one vectorised pass takes each block's max (NaN-aware), then the
// first block holding the row's max is scanned for it.
template <typename T>
void greedy_rows(const T* logits, int64_t ld, int64_t rows, int64_t vocab, int64_t* tokens, bool* finite) {
  constexpr int64_t kBlock = 256;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> block_max((vocab + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r) {
      const T* x = logits + r * ld;
      float best = -std::numeric_limits<float>::infinity();
      bool nan = false;
      for (int64_t b = 0, i0 = 0; i0 < vocab; ++b, i0 += kBlock) {
        const int64_t i1 = std::min(vocab, i0 + kBlock);
        float m = -std::numeric_limits<float>::infinity();
        int any_nan = 0;
#pragma omp simd reduction(max : m) reduction(| : any_nan)
        for (int64_t i = i0; i < i1; ++i) {
          const float v = to_float(x[i]);
          m = v > m ? v : m;
          any_nan |= int(v != v);
        }
        block_max[b] = any_nan ? std::numeric_limits<float>::quiet_NaN() : m;
        nan = nan || any_nan;
        best = m > best ? m : best;
      }
      int64_t token = 0;
      for (int64_t b = 0, i0 = 0; i0 < vocab; ++b, i0 += kBlock) {
        const float bm = block_max[b];
        if (nan ? bm != bm : bm == best) {
          for (int64_t i = i0;; ++i) {
            const float v = to_float(x[i]);
            if (nan ? v != v : v == best) {
              token = i;
              break;
            }
          }
          break;
        }
      }
      tokens[r] = token;
      finite[r] = !nan && std::isfinite(best);
    }
  });
}

}  // namespace asyncserve
