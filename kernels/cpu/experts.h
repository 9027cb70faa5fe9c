// A layer's mixture of experts in one call (asyncserve/model/llama.py's moe_mlp): the tokens routed to
// each expert gathered and run as one batch through its gate_up and down projections (each as its
// Linear holds it: decoder.h's Projection, dense or GGUF blocks), SwiGLU between, and added into the
// output scaled by their router probabilities, experts in order. In Python that is eight torch calls
// per expert hit, which at decode sizes cost more than the expert's GEMMs; here it is one call per
// layer. The router's softmax and top-k stay in torch (its topk picks among ties as transformers does).
// With LoRA on the experts (forward_lora), each expert's tokens are also ordered by adapter, and each
// adapter's run of them gets its LoRA on the expert's gate_up output and on its down output
// (lora.h's lora_segments, reading the adapter's rows in the pool through the step's tables).
#pragma once

#include <optional>
#include <vector>

#include <torch/extension.h>

#include "activation.h"
#include "common.h"
#include "decoder.h"
#include "lora.h"

namespace asyncserve {

class NativeExperts {
 public:
  // weights, types, out_features: each expert's gate_up projection, then each expert's down
  // projection, as NativeDecoder takes projections (one dense weight and no types, or GGUF parts
  // and their ggml types).
  NativeExperts(std::vector<std::vector<at::Tensor>> weights, std::vector<std::vector<int64_t>> types,
                std::vector<int64_t> out_features) {
    TORCH_CHECK(!weights.empty() && weights.size() % 2 == 0 && types.size() == weights.size() &&
                    out_features.size() == weights.size(),
                "each expert's gate_up projection, then each expert's down projection");
    const size_t experts = weights.size() / 2;
    for (size_t i = 0; i < weights.size(); ++i) {
      TORCH_CHECK(types[i].empty() ? weights[i].size() == 1 : weights[i].size() == types[i].size(),
                  "projection ", i, ": one dense weight, or one ggml type per GGUF part");
      Projection p{std::move(weights[i]), std::move(types[i]), out_features[i]};
      (i < experts ? gate_up_ : down_).push_back(std::move(p));
    }
    for (size_t e = 0; e < experts; ++e) {
      TORCH_CHECK(gate_up_[e].out_features % 2 == 0, "expert ", e, "'s gate_up has an odd number of outputs");
    }
  }

  // x: [tokens, hidden]; chosen: [tokens, k] int64, each token's experts; probs: [tokens, k] float32,
  // their weights. Returns [tokens, hidden] in x's dtype: per token the sum over its choices of
  // probs * expert(x), each product rounded to x's dtype and added in expert order (as index_add_).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& probs) const {
    return run(x, chosen, probs, std::nullopt);
  }

  // forward with each token's LoRA on the experts: flat, the pool (x's dtype); token_rows [tokens] int32,
  // each token's row of the tables (-1: none); ranks [n, P] int32, a_ptr, b_ptr [n, L, P, R] int64,
  // scaling [n, L, P] float32 (lora_segments' tables) at `layer`, whose columns first + 3e, + 1, + 2 are
  // expert e's gate, up and down projections.
  at::Tensor forward_lora(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& probs,
                          const at::Tensor& flat, const at::Tensor& token_rows, const at::Tensor& ranks,
                          const at::Tensor& a_ptr, const at::Tensor& b_ptr, const at::Tensor& scaling, int64_t layer,
                          int64_t first) const {
    TORCH_CHECK(flat.device().is_cpu() && flat.dim() == 1 && flat.is_contiguous() &&
                    flat.scalar_type() == x.scalar_type(),
                "flat must be the pool's contiguous one-dimensional view, in x's dtype");
    TORCH_CHECK(token_rows.device().is_cpu() && token_rows.scalar_type() == at::kInt && token_rows.is_contiguous() &&
                    token_rows.dim() == 1 && token_rows.size(0) == x.size(0),
                "token_rows must be a contiguous [tokens] int32 CPU tensor");
    for (const at::Tensor* t : {&a_ptr, &b_ptr})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 4 &&
                      t->sizes() == a_ptr.sizes(),
                  "a_ptr and b_ptr must be contiguous [adapters, layers, P, R] int64 CPU tensors");
    const int64_t n = a_ptr.size(0), P = a_ptr.size(2), experts = static_cast<int64_t>(gate_up_.size());
    TORCH_CHECK(ranks.device().is_cpu() && ranks.scalar_type() == at::kInt && ranks.is_contiguous() &&
                    ranks.dim() == 2 && ranks.size(0) == n && ranks.size(1) == P,
                "ranks must be a contiguous [adapters, P] int32 CPU tensor");
    TORCH_CHECK(scaling.device().is_cpu() && scaling.scalar_type() == at::kFloat && scaling.is_contiguous() &&
                    scaling.dim() == 3 && scaling.size(0) == n && scaling.size(1) == a_ptr.size(1) &&
                    scaling.size(2) == P,
                "scaling must be a contiguous [adapters, layers, P] float32 CPU tensor");
    TORCH_CHECK(layer >= 0 && layer < a_ptr.size(1), "layer ", layer, " outside the tables");
    TORCH_CHECK(first >= 0 && first + 3 * experts <= P, "the experts' columns run past the tables");
    const int32_t* row = token_rows.data_ptr<int32_t>();
    for (int64_t t = 0; t < x.size(0); ++t)
      TORCH_CHECK(row[t] >= -1 && row[t] < n, "token ", t, "'s table row ", row[t], " outside the tables");
    const LoraTables tables{ranks.data_ptr<int32_t>(), a_ptr.data_ptr<int64_t>(), b_ptr.data_ptr<int64_t>(),
                            scaling.data_ptr<float>(), a_ptr.size(1), P, a_ptr.size(3), layer};
    return run(x, chosen, probs, ExpertLora{flat, tables, row, first, n});
  }

 private:
  struct ExpertLora {
    const at::Tensor& flat;
    LoraTables tables;
    const int32_t* token_row;
    int64_t first, adapters;     // the experts' first column; the tables' rows
  };

  // lora_segments on y [n, out] += x [n, in] for an expert's rows, whose adapters' runs these are, and
  // its projections projs (tables column, first column of y, width); every row offset it will follow
  // checked against the pool first.
  template <typename T>
  static void expert_lora(const ExpertLora& lora, const at::Tensor& y, const at::Tensor& x,
                          const std::vector<LoraRun>& runs, const std::vector<LoraProjection>& projs) {
    const int64_t limit = lora.flat.numel(), fan_in = x.size(1);
    for (const LoraRun& run : runs) {
      for (const LoraProjection& p : projs) {
        const int64_t r = lora.tables.rank(run.adapter, p.index);
        TORCH_CHECK(r >= 0 && r <= lora.tables.max_rank, "rank ", r, " outside the tables");
        const int64_t* a = lora.tables.a_rows(run.adapter, p.index);
        const int64_t* b = lora.tables.b_rows(run.adapter, p.index);
        for (int64_t j = 0; j < r; ++j)
          TORCH_CHECK(a[j] >= 0 && a[j] + fan_in <= limit && b[j] >= 0 && b[j] + p.fan_out <= limit,
                      "adapter row outside the pool");
      }
    }
    lora_segments<T>(y.data_ptr<T>(), y.stride(0), x.data_ptr<T>(), x.stride(0), fan_in, lora.flat.data_ptr<T>(),
                     lora.tables, runs.data(), static_cast<int64_t>(runs.size()), projs.data(),
                     static_cast<int64_t>(projs.size()));
  }

  at::Tensor run(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& probs,
                 const std::optional<ExpertLora>& lora) const {
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                    (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "x must be a contiguous [tokens, hidden] float32 or bfloat16 CPU tensor");
    TORCH_CHECK(chosen.device().is_cpu() && chosen.scalar_type() == at::kLong && chosen.is_contiguous() &&
                    chosen.dim() == 2 && chosen.size(0) == x.size(0),
                "chosen must be a contiguous [tokens, k] int64 CPU tensor");
    TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.is_contiguous() &&
                    probs.sizes() == chosen.sizes(),
                "probs must be a contiguous float32 CPU tensor shaped as chosen");
    const int64_t tokens = x.size(0), k = chosen.size(1), pairs = tokens * k, hidden = x.size(1);
    const int64_t experts = static_cast<int64_t>(gate_up_.size());
    // the (token, choice) pairs grouped by expert, tokens in order within each (a counting sort); with
    // LoRA, by (expert, the token's table row), so that each adapter's rows of an expert are one run
    const int64_t adapters = lora ? lora->adapters : 0;
    const int64_t per_expert = adapters + 1;
    const int64_t* expert_of = chosen.data_ptr<int64_t>();
    const float* weight_of = probs.data_ptr<float>();
    auto bucket = [&](int64_t i) {
      return expert_of[i] * per_expert + (lora ? lora->token_row[i / k] + 1 : 0);
    };
    std::vector<int64_t> start(experts * per_expert + 1, 0);
    for (int64_t i = 0; i < pairs; ++i) {
      TORCH_CHECK(expert_of[i] >= 0 && expert_of[i] < experts, "expert ", expert_of[i], " out of range [0, ",
                  experts, ")");
      ++start[bucket(i) + 1];
    }
    for (size_t b = 0; b + 1 < start.size(); ++b) start[b + 1] += start[b];
    at::Tensor rows = at::empty({pairs}, chosen.options());
    std::vector<float> scale(pairs);
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    int64_t* row = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t slot = next[bucket(i)]++;
      row[slot] = i / k;
      scale[slot] = weight_of[i];
    }
    at::Tensor out = at::zeros_like(x);
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t first = start[e * per_expert], n = start[(e + 1) * per_expert] - first;
      if (n == 0) continue;
      at::Tensor xe = x.index_select(0, rows.narrow(0, first, n));                      // [n, hidden]
      at::Tensor gate_up = gate_up_[e](xe);                                             // [n, 2 inter]
      const int64_t inter = gate_up.size(1) / 2;
      std::vector<LoraRun> runs;          // the expert's rows of each adapter (row -1's bucket has none)
      for (int64_t a = 0; lora && a < adapters; ++a) {
        const int64_t b = e * per_expert + a + 1;
        if (start[b + 1] > start[b]) runs.push_back({start[b] - first, start[b + 1] - first, a});
      }
      at::Tensor act = at::empty({n, inter}, x.options());
      at::Tensor y;
      dispatch_dtype(x, [&](auto zero) {
        using T = decltype(zero);
        const int64_t column = lora ? lora->first + 3 * e : 0;
        if (!runs.empty()) expert_lora<T>(*lora, gate_up, xe, runs, {{column, 0, inter}, {column + 1, inter, inter}});
        gated_mul<T, silu>(gate_up.data_ptr<T>(), gate_up.stride(0), act.data_ptr<T>(), inter, n, inter);
        y = down_[e](act).contiguous();                                                 // [n, hidden]
        if (!runs.empty()) expert_lora<T>(*lora, y, act, runs, {{column + 2, 0, hidden}});
        add_scaled<T>(y.data_ptr<T>(), out.data_ptr<T>(), row + first, scale.data() + first, n, hidden);
      });
    }
    return out;
  }

  // out[row[j]] += round(y[j] * scale[j]) for each of the n rows of y [n, hidden]
  template <typename T>
  static void add_scaled(const T* y, T* out, const int64_t* row, const float* scale, int64_t n, int64_t hidden) {
    for (int64_t j = 0; j < n; ++j) {
      T* o = out + row[j] * hidden;
      const T* yj = y + j * hidden;
      for (int64_t c = 0; c < hidden; ++c) {
        o[c] = from_float<T>(to_float(o[c]) + to_float(from_float<T>(to_float(yj[c]) * scale[j])));
      }
    }
  }

  std::vector<Projection> gate_up_, down_;
};

}  // namespace asyncserve
