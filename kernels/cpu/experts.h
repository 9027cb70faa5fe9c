// A layer's mixture of experts in one call (asyncserve/model/llama.py's moe_mlp): the tokens routed to
// each expert gathered and run as one batch through its gate_up and down projections (each as its
// Linear holds it: decoder.h's Projection, dense or GGUF blocks), SwiGLU between, and added into the
// output scaled by their router probabilities, experts in order. In Python that is eight torch calls
// per expert hit, which at decode sizes cost more than the expert's GEMMs; here it is one call per
// layer. The router's softmax and top-k stay in torch (its topk picks among ties as transformers does).
#pragma once

#include <vector>

#include <torch/extension.h>

#include "activation.h"
#include "common.h"
#include "decoder.h"

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
    // the (token, choice) pairs grouped by expert, tokens in order within each (a counting sort)
    const int64_t* expert_of = chosen.data_ptr<int64_t>();
    const float* weight_of = probs.data_ptr<float>();
    std::vector<int64_t> start(experts + 1, 0);
    for (int64_t i = 0; i < pairs; ++i) {
      TORCH_CHECK(expert_of[i] >= 0 && expert_of[i] < experts, "expert ", expert_of[i], " out of range [0, ",
                  experts, ")");
      ++start[expert_of[i] + 1];
    }
    for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
    at::Tensor rows = at::empty({pairs}, chosen.options());
    std::vector<float> scale(pairs);
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    int64_t* row = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t slot = next[expert_of[i]]++;
      row[slot] = i / k;
      scale[slot] = weight_of[i];
    }
    at::Tensor out = at::zeros_like(x);
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t first = start[e], n = start[e + 1] - first;
      if (n == 0) continue;
      at::Tensor gate_up = gate_up_[e](x.index_select(0, rows.narrow(0, first, n)));   // [n, 2 inter]
      const int64_t inter = gate_up.size(1) / 2;
      at::Tensor act = at::empty({n, inter}, x.options());
      at::Tensor y;
      if (x.scalar_type() == at::kFloat) {
        gated_mul<float, silu>(gate_up.data_ptr<float>(), gate_up.stride(0), act.data_ptr<float>(), inter, n, inter);
        y = down_[e](act).contiguous();                                                 // [n, hidden]
        add_scaled<float>(y.data_ptr<float>(), out.data_ptr<float>(), row + first, scale.data() + first, n, hidden);
      } else {
        gated_mul<bf16, silu>(gate_up.data_ptr<bf16>(), gate_up.stride(0), act.data_ptr<bf16>(), inter, n, inter);
        y = down_[e](act).contiguous();
        add_scaled<bf16>(y.data_ptr<bf16>(), out.data_ptr<bf16>(), row + first, scale.data() + first, n, hidden);
      }
    }
    return out;
  }

 private:
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
