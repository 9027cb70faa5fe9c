// The decoder's layer loop in one call: model/llama.py's forward on the native path, from the
// embedded tokens to the logits of the sampled rows, running the same checked ops (ops.cpp) in the
// same order, so its logits are bit for bit those of the Python loop. The Python loop spends
// about 2 ms per step between the kernels (views, dispatch, the LoRA hook's calls; 2.1 ms of a
// 20 ms W1 decode step and 1.9 of 7.8 ms at one decode on the Zen 4 of BENCHMARKS.md); here that
// is gone and the GIL is released for the whole step. It runs where every projection is packed
// for gemm.h (bf16 on AVX512-BF16 CPUs) and the step's LoRA, if any, is lora_segments' (the torch
// backend's native plans; no CPU-assisted rows). Included by ops.cpp after the ops (one
// translation unit).
#pragma once

#include <atomic>
#include <cmath>
#include <vector>

namespace asyncserve {

// Whether each projection's GEMM asks for the rows of the next group's LoRA as it computes (on at
// start); off for benchmarks and tests to compare.
inline std::atomic<bool> lora_rows_ahead_on{true};

// Projection groups, in the order forward's per-group arguments come in.
enum Group { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3, kGroups = 4 };

struct PackedProjection {
  at::Tensor packed;          // [ceil(out / 16), in / 2, 16, 2] bf16 (NativeLinear)
  int64_t out_features;
};

struct DecoderLayer {
  at::Tensor input_norm, post_norm;        // [hidden]
  PackedProjection groups[kGroups];
};

// The step's LoRA as lora_segments takes it: flat pool, adapter tables and, per group, its runs
// (undefined: no step adapter targets the group) and projections. No flat: no LoRA this step.
struct StepLora {
  c10::optional<at::Tensor> flat;
  std::vector<c10::optional<at::Tensor>> runs;
  std::vector<at::Tensor> projections;
  at::Tensor ranks, a_ptr, b_ptr, scaling;
};

class NativeDecoder {
 public:
  // norms: input_norm, post_norm per layer; packed, out_features: qkv, o, gate_up, down per layer
  // (kGroups order); final_norm: [hidden]; lm_head: packed like the projections.
  NativeDecoder(std::vector<at::Tensor> norms, std::vector<at::Tensor> packed, std::vector<int64_t> out_features,
                at::Tensor final_norm, at::Tensor lm_head, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                double eps)
      : final_norm_(std::move(final_norm)), nh_(num_heads), nkv_(num_kv_heads), hd_(head_dim), eps_(eps) {
    const size_t layers = norms.size() / 2;
    TORCH_CHECK(norms.size() == 2 * layers && packed.size() == kGroups * layers + 1 &&
                    out_features.size() == packed.size(),
                "two norms per layer, four projections per layer and the lm_head");
    for (size_t l = 0; l < layers; ++l) {
      DecoderLayer layer{norms[2 * l], norms[2 * l + 1], {}};
      for (int g = 0; g < kGroups; ++g) layer.groups[g] = {packed[kGroups * l + g], out_features[kGroups * l + g]};
      layers_.push_back(std::move(layer));
    }
    lm_head_ = {packed.back(), out_features.back()};
  }

  // h: [T, hidden] embedded tokens (updated in place: the residual stream); positions, write_rows
  // [T]; cos, sin: the RoPE tables; kv: the pool's KV view [pages, 2, layers, block, kv_size]. The
  // first num_decode rows decode (decode_tables [n, max_pages], decode_lens [n]); the rest are
  // prefill chunks (prefill_tables, prefill_starts, prefill_first_pos as paged_prefill_attention
  // takes them). Returns the logits of rows sample_index: [rows, vocab].
  at::Tensor forward(at::Tensor h, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv,
                     at::Tensor write_rows, int64_t num_decode, at::Tensor decode_tables, at::Tensor decode_lens,
                     at::Tensor prefill_tables, at::Tensor prefill_starts, at::Tensor prefill_first_pos,
                     at::Tensor sample_index, c10::optional<at::Tensor> flat,
                     std::vector<c10::optional<at::Tensor>> runs, std::vector<at::Tensor> projections,
                     c10::optional<at::Tensor> ranks, c10::optional<at::Tensor> a_ptr,
                     c10::optional<at::Tensor> b_ptr, c10::optional<at::Tensor> scaling) const {
    const int64_t T = h.size(0), layers = int64_t(layers_.size());
    TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.size(2) == layers, "kv must be [pages, 2, layers, block, kv_size]");
    TORCH_CHECK(num_decode >= 0 && num_decode <= T, "num_decode outside the step's rows");
    StepLora lora;
    if (flat) {
      TORCH_CHECK(runs.size() == kGroups && projections.size() == kGroups && ranks && a_ptr && b_ptr && scaling,
                  "LoRA needs runs and projections per group and the four tables");
      lora = {flat, std::move(runs), std::move(projections), *ranks, *a_ptr, *b_ptr, *scaling};
    }
    const int64_t block = kv.size(3), q_size = nh_ * hd_;
    const at::Tensor kv_rows = kv.view({-1, kv.size(4)});
    const double scale = std::pow(double(hd_), -0.5);             // as Python's hd ** -0.5
    at::Tensor x = add_rms_norm_op(h, c10::nullopt, layers_[0].input_norm, eps_);
    for (int64_t li = 0; li < layers; ++li) {
      const DecoderLayer& L = layers_[li];
      const at::Tensor qkv = project(kQkv, li, x, L, lora);                       // [T, q + 2 kv]
      rope_write_kv_op(qkv, positions, cos, sin, kv_rows, write_rows, li * block, (layers + li) * block, nh_, nkv_);
      const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, nh_, hd_});
      const at::Tensor k_cache = kv.select(1, 0).select(1, li), v_cache = kv.select(1, 1).select(1, li);
      const at::Tensor attn = at::empty({T, nh_, hd_}, h.options());
      if (num_decode > 0)
        paged_decode_attention_op(attn.narrow(0, 0, num_decode), q.narrow(0, 0, num_decode), k_cache, v_cache,
                                  decode_tables, decode_lens, scale);
      if (num_decode < T)
        paged_prefill_attention_op(attn, q, k_cache, v_cache, prefill_tables, prefill_starts, prefill_first_pos, scale);
      const at::Tensor attn_rows = attn.view({T, q_size});
      const at::Tensor o = project(kO, li, attn_rows, L, lora);
      x = add_rms_norm_op(h, o, L.post_norm, eps_);                               // h += o
      const at::Tensor act = silu_mul_op(project(kGateUp, li, x, L, lora));        // [T, inter]
      const at::Tensor d = project(kDown, li, act, L, lora);
      if (li + 1 < layers)
        x = add_rms_norm_op(h, d, layers_[li + 1].input_norm, eps_);              // h += d
      else
        h.add_(d);
    }
    const at::Tensor hs = add_rms_norm_op(h.index_select(0, sample_index), c10::nullopt, final_norm_, eps_);
    return packed_linear_op(hs, lm_head_.packed, lm_head_.out_features);
  }

 private:
  // The group's base projection of x, plus the step's LoRA for the group where it has some. The GEMM
  // asks for the rows that the next group's LoRA will read, where it has some (for adapters on q and
  // v: down asks for the next layer's), so that they come from cache: a decode step of 31 adapters'
  // q and v rows took 2.4 ms from DRAM and 0.8 from cache (Zen 4, BENCHMARKS.md).
  at::Tensor project(Group g, int64_t layer, const at::Tensor& x, const DecoderLayer& L, const StepLora& lora) const {
    const bool asks = x.size(0) >= kSideStreamFromRows && !amx_tiles_run(x.size(1) / 2);   // gemm.h's tiles that ask
    const std::vector<PrefetchSpan> ahead = asks ? next_lora_rows(g, layer, lora) : std::vector<PrefetchSpan>{};
    at::Tensor y = packed_linear_op(x, L.groups[g].packed, L.groups[g].out_features, ahead.empty() ? nullptr : &ahead);
    if (lora.flat && lora.runs[g])
      lora_segments_op(y, x, *lora.flat, *lora.runs[g], lora.ranks, lora.a_ptr, lora.b_ptr, lora.scaling, layer,
                       lora.projections[g]);
    return y;
  }

  // The pool rows of the LoRA call after group g's at `layer`, if that group has LoRA this step.
  std::vector<PrefetchSpan> next_lora_rows(Group g, int64_t layer, const StepLora& lora) const {
    const Group next = Group((g + 1) % kGroups);
    const int64_t next_layer = next == kQkv ? layer + 1 : layer;
    if (!lora.flat || !lora.runs[next] || next_layer == int64_t(layers_.size()) ||
        !lora_rows_ahead_on.load(std::memory_order_relaxed))
      return {};
    const at::Tensor& runs = *lora.runs[next];
    const at::Tensor& projs = lora.projections[next];
    const LoraTables tables{lora.ranks.data_ptr<int32_t>(), lora.a_ptr.data_ptr<int64_t>(), lora.b_ptr.data_ptr<int64_t>(),
                            lora.scaling.data_ptr<float>(), lora.a_ptr.size(1), lora.a_ptr.size(2), lora.a_ptr.size(3),
                            next_layer};
    const int64_t fan_in = 2 * layers_[next_layer].groups[next].packed.size(1);   // [blocks, in / 2, 16, 2]
    return lora_spans(lora.flat->data_ptr<bf16>(), tables, reinterpret_cast<const LoraRun*>(runs.data_ptr<int64_t>()),
                      runs.size(0), reinterpret_cast<const LoraProjection*>(projs.data_ptr<int64_t>()), projs.size(0),
                      fan_in);
  }

  std::vector<DecoderLayer> layers_;
  PackedProjection lm_head_;
  at::Tensor final_norm_;
  int64_t nh_, nkv_, hd_;
  double eps_;
};

}  // namespace asyncserve
