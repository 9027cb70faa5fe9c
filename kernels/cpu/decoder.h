// The decoder's layer loop in one call: model/llama.py's forward on the native path, from the
// embedded tokens to the logits of the sampled rows, running the same checked ops (ops.cpp) in the
// same order, so its logits are bit for bit those of the Python loop. The Python loop spends
// about 2 ms per step between the kernels (views, dispatch, the LoRA hook's calls; 2.1 ms of a
// 20 ms W1 decode step and 1.9 of 7.8 ms at one decode on the Zen 4 of BENCHMARKS.md); here that
// is gone and the GIL is released for the whole step. One loop for every family: a layer's
// optional pieces (q/k/v biases, per-head q/k norms, Gemma's (1 + w) and sandwich norms, GeGLU,
// sliding windows with their own RoPE tables, the attention's scale and soft cap) are data, and so is
// each projection's form, as its Linear holds it: packed for gemm.h on AVX512-BF16 CPUs, oneDNN's or
// torch's otherwise, or GGUF blocks for quant.h. It runs where the step's LoRA, if any, is
// lora_segments' (the torch backend's native plans; no CPU-assisted rows). Included by ops.cpp after
// the ops (one translation unit).
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

// A projection's weight as model/linear.py holds it, applied by the op its Linear calls: packed for
// gemm.h (NativeLinear: [ceil(out / 16), in / 2, 16, 2] bf16 or [ceil(out / 16), in, 16, 1] float32),
// reordered for oneDNN (OneDnnLinear: an mkldnn tensor), as given (Linear: [out, in], F.linear) or kept
// in GGUF blocks (QuantLinear: its parts, each [out_i, bytes per row] uint8 of one ggml type, stacked
// as output columns; quant.h).
struct Projection {
  std::vector<at::Tensor> parts;   // one dense weight, or the GGUF parts
  std::vector<int64_t> types;      // the parts' ggml types; empty: dense
  int64_t out_features;

  bool quantized() const { return !types.empty(); }
  const at::Tensor& weight() const { return parts.front(); }
  bool packed() const { return !quantized() && !weight().is_mkldnn() && weight().dim() == 4; }

  // x: [rows, in] -> [rows, out_features]; side: what a packed GEMM asks for as it goes (gemm.h)
  at::Tensor operator()(const at::Tensor& x, const std::vector<PrefetchSpan>* side = nullptr) const {
    if (quantized()) return quant_linear_op(x, parts, types);
    if (packed()) return packed_linear_op(x, weight(), out_features, side);
    if (weight().is_mkldnn()) {   // torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
      static const c10::OperatorHandle op =
          c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
      std::vector<c10::IValue> stack{x, weight(), c10::IValue(), std::string("none"),
                                     c10::List<c10::optional<at::Scalar>>(), std::string("")};
      op.callBoxed(&stack);
      return stack[0].toTensor();
    }
    return at::linear(x, weight());
  }
};

// A layer's weights and what its family adds to Llama's layer (model/config.py's Family): norm
// weights of h's dtype, or float32 for Gemma's (1 + w) (norm.h); the optional pieces undefined
// where the family has none.
struct DecoderLayer {
  at::Tensor input_norm, post_norm;             // [hidden]: attention's and MLP's input norms; undefined:
                                                // none (OLMo 2: the outputs' norms only)
  Projection groups[kGroups];
  c10::optional<at::Tensor> qkv_bias;           // [q + 2 kv] (Qwen2)
  c10::optional<at::Tensor> q_norm, k_norm;     // [head_dim], per head before RoPE (Qwen3, Gemma 3); or
                                                // [q], [kv]: q and k whole (OLMo 2)
  c10::optional<at::Tensor> attn_out_norm;      // [hidden], on the attention's output (Gemma)
  c10::optional<at::Tensor> mlp_out_norm;       // [hidden], on the MLP's output (Gemma)
  int64_t window;                               // sliding window; 0: global attention
  bool local_rope;                              // RoPE from the local tables (Gemma 3's sliding layers'
                                                // base; SmolLM3's NoPE layers: identity tables)
};

// The step's LoRA as lora_segments takes it: flat pool, adapter tables and, per group, its runs
// (undefined: no step adapter targets the group) and projections. No flat: no LoRA this step.
// DoRA adapters' rows (asyncserve/lora/dora.py): dora_runs [n, 4] (first row, end row, index into
// dora_scales, bit g set where the adapter has DoRA projections in group g), each scale [layers, all
// groups' outputs] float32, group g's columns from dora_columns[g] to dora_columns[g + 1].
struct StepLora {
  c10::optional<at::Tensor> flat;
  std::vector<c10::optional<at::Tensor>> runs;
  std::vector<at::Tensor> projections;
  at::Tensor ranks, a_ptr, b_ptr, scaling;
  c10::optional<at::Tensor> dora_runs;
  std::vector<at::Tensor> dora_scales;
  std::vector<int64_t> dora_columns;
};

// Per layer, in this order, the tensors that NativeDecoder's constructor takes in `norms`.
constexpr size_t kLayerTensors = 7;

class NativeDecoder {
 public:
  // layer_tensors: per layer input_norm, post_norm, qkv_bias, q_norm, k_norm, attn_out_norm,
  // mlp_out_norm (None where the family has none); weights, types, out_features: qkv, o, gate_up,
  // down per layer (kGroups order), then the lm_head's, each as its Linear holds it (Projection: one
  // dense weight and no types, or GGUF parts and their types); windows: per layer, 0 for global
  // attention; local_rope: per layer, whether it takes forward's local tables; final_norm: [hidden];
  // residual_scale: each attention and MLP output's factor before its residual add (Granite). scale, softcap (0: none): the attention scores'; gelu: GeGLU,
  // else SwiGLU.
  NativeDecoder(std::vector<c10::optional<at::Tensor>> layer_tensors, std::vector<std::vector<at::Tensor>> weights,
                std::vector<std::vector<int64_t>> types, std::vector<int64_t> out_features,
                std::vector<int64_t> windows, std::vector<bool> local_rope, at::Tensor final_norm, int64_t num_heads, int64_t num_kv_heads,
                int64_t head_dim, double eps, double scale, double softcap, bool gelu, double residual_scale)
      : final_norm_(std::move(final_norm)), nh_(num_heads), nkv_(num_kv_heads), hd_(head_dim), eps_(eps),
        scale_(scale), softcap_(softcap), gelu_(gelu), residual_scale_(residual_scale) {
    const size_t layers = windows.size();
    TORCH_CHECK(layer_tensors.size() == kLayerTensors * layers && weights.size() == kGroups * layers + 1 &&
                    types.size() == weights.size() && out_features.size() == weights.size() &&
                    local_rope.size() == layers,
                "seven norm and bias tensors, four projections and a local_rope flag per layer, and the lm_head");
    std::vector<Projection> projections;
    for (size_t i = 0; i < weights.size(); ++i) {
      TORCH_CHECK(types[i].empty() ? weights[i].size() == 1 : weights[i].size() == types[i].size(),
                  "projection ", i, ": one dense weight, or one ggml type per GGUF part");
      projections.push_back({std::move(weights[i]), std::move(types[i]), out_features[i]});
    }
    for (size_t l = 0; l < layers; ++l) {
      const auto* t = layer_tensors.data() + kLayerTensors * l;
      TORCH_CHECK(t[0].has_value() == t[1].has_value() && t[3].has_value() == t[4].has_value() &&
                      t[5].has_value() == t[6].has_value() && (t[0] || t[5]),
                  "layer ", l, ": input norms both or neither (then output norms), q and k norms both or neither, "
                  "output norms both or neither");
      TORCH_CHECK(windows[l] >= 0, "windows must be 0 (global) or positive");
      DecoderLayer layer{t[0] ? *t[0] : at::Tensor(), t[1] ? *t[1] : at::Tensor(), {}, t[2], t[3], t[4], t[5], t[6],
                         windows[l], local_rope[l]};
      for (int g = 0; g < kGroups; ++g) layer.groups[g] = projections[kGroups * l + g];
      layers_.push_back(std::move(layer));
    }
    lm_head_ = projections.back();
  }

  // h: [T, hidden] embedded tokens (scaled where the family scales them; updated in place: the
  // residual stream); positions, write_rows [T]; cos, sin: the RoPE tables, local_cos, local_sin the
  // sliding layers' (the same tensors where they share them); kv: the pool's KV view [pages, 2,
  // layers, block, kv_size]. The first num_decode rows decode (decode_tables [n, max_pages],
  // decode_lens [n]); the rest are prefill chunks (prefill_tables, prefill_starts, prefill_first_pos
  // as paged_prefill_attention takes them). Returns the logits of rows sample_index: [rows, vocab]
  // (before any final soft-capping). head_runs [n, 3] (first logits row, end row, index into head_a,
  // head_bt and head_scaling): LoRA on the LM head added to those rows, as lora/vocab.py's head_; an
  // empty head_a marks a head saved whole, head_bt then its weight [vocab, hidden], whose logits replace them.
  at::Tensor forward(at::Tensor h, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor local_cos,
                     at::Tensor local_sin, at::Tensor kv, at::Tensor write_rows, int64_t num_decode,
                     at::Tensor decode_tables, at::Tensor decode_lens, at::Tensor prefill_tables,
                     at::Tensor prefill_starts, at::Tensor prefill_first_pos, at::Tensor sample_index,
                     c10::optional<at::Tensor> flat, std::vector<c10::optional<at::Tensor>> runs,
                     std::vector<at::Tensor> projections, c10::optional<at::Tensor> ranks,
                     c10::optional<at::Tensor> a_ptr, c10::optional<at::Tensor> b_ptr,
                     c10::optional<at::Tensor> scaling, c10::optional<at::Tensor> dora_runs,
                     std::vector<at::Tensor> dora_scales, std::vector<int64_t> dora_columns,
                     c10::optional<at::Tensor> head_runs, std::vector<at::Tensor> head_a,
                     std::vector<at::Tensor> head_bt, std::vector<double> head_scaling) const {
    const int64_t T = h.size(0), layers = int64_t(layers_.size());
    TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.size(2) == layers, "kv must be [pages, 2, layers, block, kv_size]");
    TORCH_CHECK(num_decode >= 0 && num_decode <= T, "num_decode outside the step's rows");
    StepLora lora;
    if (flat) {
      TORCH_CHECK(runs.size() == kGroups && projections.size() == kGroups && ranks && a_ptr && b_ptr && scaling,
                  "LoRA needs runs and projections per group and the four tables");
      lora = {flat, std::move(runs), std::move(projections), *ranks, *a_ptr, *b_ptr, *scaling};
      if (dora_runs) {
        TORCH_CHECK(dora_runs->dim() == 2 && dora_runs->size(1) == 4 && dora_runs->scalar_type() == at::kLong &&
                        dora_columns.size() == kGroups + 1,
                    "DoRA needs runs [n, 4] int64 and kGroups + 1 column bounds");
        for (const at::Tensor& s : dora_scales)
          TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 && s.size(0) == layers &&
                          s.size(1) == dora_columns.back(),
                      "DoRA scales must be contiguous float32 [layers, all groups' outputs]");
        const auto r = dora_runs->accessor<int64_t, 2>();
        for (int64_t i = 0; i < r.size(0); ++i)
          TORCH_CHECK(0 <= r[i][0] && r[i][0] <= r[i][1] && r[i][1] <= T && 0 <= r[i][2] &&
                          r[i][2] < int64_t(dora_scales.size()),
                      "DoRA run ", i, " outside the step's rows or scales");
        lora.dora_runs = dora_runs;
        lora.dora_scales = std::move(dora_scales);
        lora.dora_columns = std::move(dora_columns);
      }
    }
    const int64_t block = kv.size(3), q_size = nh_ * hd_;
    const at::Tensor kv_rows = kv.view({-1, kv.size(4)});
    at::Tensor x = residual_norm(h, c10::nullopt, layers_[0].input_norm);
    for (int64_t li = 0; li < layers; ++li) {
      const DecoderLayer& L = layers_[li];
      const at::Tensor qkv = project(kQkv, li, x, L, lora);                       // [T, q + 2 kv]
      if (L.qkv_bias) qkv.add_(*L.qkv_bias);
      if (L.q_norm) head_rms_norm_op(qkv, *L.q_norm, *L.k_norm, nh_, nkv_, eps_);
      const bool local = L.local_rope;
      rope_write_kv_op(qkv, positions, local ? local_cos : cos, local ? local_sin : sin, kv_rows, write_rows,
                       li * block, (layers + li) * block, nh_, nkv_);
      const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, nh_, hd_});
      const at::Tensor k_cache = kv.select(1, 0).select(1, li), v_cache = kv.select(1, 1).select(1, li);
      const at::Tensor attn = at::empty({T, nh_, hd_}, h.options());
      if (num_decode > 0)
        paged_decode_attention_op(attn.narrow(0, 0, num_decode), q.narrow(0, 0, num_decode), k_cache, v_cache,
                                  decode_tables, decode_lens, scale_, L.window, softcap_);
      if (num_decode < T)
        paged_prefill_attention_op(attn, q, k_cache, v_cache, prefill_tables, prefill_starts, prefill_first_pos,
                                   scale_, L.window, softcap_);
      const at::Tensor attn_rows = attn.view({T, q_size});
      at::Tensor o = project(kO, li, attn_rows, L, lora);
      if (L.attn_out_norm) o = add_rms_norm_op(o, c10::nullopt, *L.attn_out_norm, eps_);
      if (residual_scale_ != 1.0) scale_rows(o, residual_scale_);
      x = residual_norm(h, o, L.post_norm);                                      // h += o
      const at::Tensor gate_up = project(kGateUp, li, x, L, lora);                // [T, 2 inter]
      const at::Tensor act = gelu_ ? gated_mul_op<gelu_tanh>(gate_up) : gated_mul_op<silu>(gate_up);   // [T, inter]
      at::Tensor d = project(kDown, li, act, L, lora);
      if (L.mlp_out_norm) d = add_rms_norm_op(d, c10::nullopt, *L.mlp_out_norm, eps_);
      if (residual_scale_ != 1.0) scale_rows(d, residual_scale_);
      if (li + 1 < layers)
        x = residual_norm(h, d, layers_[li + 1].input_norm);                     // h += d
      else
        h.add_(d);
    }
    const at::Tensor hs = add_rms_norm_op(h.index_select(0, sample_index), c10::nullopt, final_norm_, eps_);
    at::Tensor logits = lm_head_(hs);
    if (head_runs) add_head_lora(logits, hs, *head_runs, head_a, head_bt, head_scaling);
    return logits;
  }

 private:
  // The group's base projection of x, plus the step's LoRA for the group where it has some. The GEMM
  // asks for the rows that the next group's LoRA will read, where it has some (for adapters on q and
  // v: down asks for the next layer's), so that they come from cache: a decode step of 31 adapters'
  // q and v rows took 2.4 ms from DRAM and 0.8 from cache (Zen 4, BENCHMARKS.md).
  at::Tensor project(Group g, int64_t layer, const at::Tensor& x, const DecoderLayer& L, const StepLora& lora) const {
    const Projection& base = L.groups[g];
    const bool asks = base.packed() && x.size(0) >= kSideStreamFromRows && !amx_tiles_run(x.size(1) / 2);   // gemm.h's tiles that ask
    const std::vector<PrefetchSpan> ahead = asks ? next_lora_rows(g, layer, lora) : std::vector<PrefetchSpan>{};
    at::Tensor y = base(x, ahead.empty() ? nullptr : &ahead);
    if (lora.flat && lora.runs[g])
      lora_segments_op(y, x, *lora.flat, *lora.runs[g], lora.ranks, lora.a_ptr, lora.b_ptr, lora.scaling, layer,
                       lora.projections[g]);
    if (lora.dora_runs) scale_dora_rows(y, g, layer, lora);
    return y;
  }

  // h += delta, and the next input: h normed with norm, or (undefined norm: OLMo 2) a copy of h.
  at::Tensor residual_norm(at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& norm) const {
    if (norm.defined()) return add_rms_norm_op(h, delta, norm, eps_);
    if (delta) h.add_(*delta);
    return h.clone();
  }

  // y *= factor as torch's `y * factor` rounds it (the product in float, one rounding): ATen's
  // Tensor::mul_(double) rounds the factor to a bfloat16 tensor's type first.
  static void scale_rows(at::Tensor& y, double factor) {
    TORCH_CHECK(y.is_contiguous(), "scale_rows: y must be contiguous");
    dispatch_dtype(y, [&](auto zero) {
      using T = decltype(zero);
      T* v = y.data_ptr<T>();
      const float f = static_cast<float>(factor);
      for (int64_t i = 0, n = y.numel(); i < n; ++i) v[i] = from_float<T>(to_float(v[i]) * f);
    });
  }

  // LoRA on the LM head: logits[run] += ((hs[run] · A^T) · B^T) · s, or a head saved whole (A empty, B^T
  // its weight W): logits[run] = hs[run] · W^T; the same ATen calls as VocabStep.head_.
  static void add_head_lora(at::Tensor& logits, const at::Tensor& hs, const at::Tensor& runs,
                            const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& bt,
                            const std::vector<double>& scaling) {
    TORCH_CHECK(runs.dim() == 2 && runs.size(1) == 3 && runs.scalar_type() == at::kLong && a.size() == bt.size() &&
                    a.size() == scaling.size(), "head LoRA needs runs [n, 3] int64 and A, B^T and a scaling each");
    const auto r = runs.accessor<int64_t, 2>();
    for (int64_t i = 0; i < r.size(0); ++i) {
      const int64_t start = r[i][0], n = r[i][1] - r[i][0], k = r[i][2];
      TORCH_CHECK(0 <= start && 0 <= n && r[i][1] <= logits.size(0) && 0 <= k && k < int64_t(a.size()),
                  "head LoRA run ", i, " outside the logits' rows or the adapters");
      if (a[k].numel() == 0)
        logits.narrow(0, start, n).copy_(at::matmul(hs.narrow(0, start, n), bt[k].t()));
      else
        logits.narrow(0, start, n).add_(at::matmul(at::matmul(hs.narrow(0, start, n), a[k].t()), bt[k]).mul(scaling[k]));
    }
  }

  // DoRA: each DoRA adapter's rows of y [T, group's outputs] times its scale g for this layer's group,
  // in float, rounded once (DoraLora.project's multiply, bit for bit; one ATen call per run cost W1's
  // four adapters 18% of their throughput on box G).
  static void scale_dora_rows(at::Tensor& y, Group g, int64_t layer, const StepLora& lora) {
    const auto runs = lora.dora_runs->accessor<int64_t, 2>();
    const int64_t c0 = lora.dora_columns[g], width = lora.dora_columns[g + 1] - c0;
    TORCH_CHECK(y.is_contiguous() && y.size(1) == width, "DoRA: the group's output must be contiguous [T, ", width, "]");
    dispatch_dtype(y, [&](auto zero) {
      using T = decltype(zero);
      T* out = y.data_ptr<T>();
      for (int64_t i = 0; i < runs.size(0); ++i) {
        if (!((runs[i][3] >> g) & 1)) continue;
        const at::Tensor& scale = lora.dora_scales[runs[i][2]];
        const float* s = scale.data_ptr<float>() + layer * scale.size(1) + c0;
        for (int64_t row = runs[i][0]; row < runs[i][1]; ++row) {
          T* r = out + row * width;
          for (int64_t c = 0; c < width; ++c) r[c] = from_float<T>(to_float(r[c]) * s[c]);
        }
      }
    });
  }

  // The pool rows of the LoRA call after group g's at `layer`, if that group has LoRA this step.
  std::vector<PrefetchSpan> next_lora_rows(Group g, int64_t layer, const StepLora& lora) const {
    const Group next = Group((g + 1) % kGroups);
    const int64_t next_layer = next == kQkv ? layer + 1 : layer;
    if (!lora.flat || !lora.runs[next] || next_layer == int64_t(layers_.size()) ||
        !layers_[next_layer].groups[next].packed() || !lora_rows_ahead_on.load(std::memory_order_relaxed))
      return {};
    const at::Tensor& runs = *lora.runs[next];
    const at::Tensor& projs = lora.projections[next];
    const LoraTables tables{lora.ranks.data_ptr<int32_t>(), lora.a_ptr.data_ptr<int64_t>(), lora.b_ptr.data_ptr<int64_t>(),
                            lora.scaling.data_ptr<float>(), lora.a_ptr.size(1), lora.a_ptr.size(2), lora.a_ptr.size(3),
                            next_layer};
    const at::Tensor& packed = layers_[next_layer].groups[next].weight();   // [blocks, in / per_lane, 16, per_lane]
    const int64_t fan_in = packed.size(1) * packed.size(3);
    std::vector<PrefetchSpan> spans;
    dispatch_dtype(*lora.flat, [&](auto zero) {
      using T = decltype(zero);
      spans = lora_spans(lora.flat->data_ptr<T>(), tables, reinterpret_cast<const LoraRun*>(runs.data_ptr<int64_t>()),
                         runs.size(0), reinterpret_cast<const LoraProjection*>(projs.data_ptr<int64_t>()),
                         projs.size(0), fan_in);
    });
    return spans;
  }

  std::vector<DecoderLayer> layers_;
  Projection lm_head_;
  at::Tensor final_norm_;
  int64_t nh_, nkv_, hd_;
  double eps_, scale_, softcap_;
  bool gelu_;
  double residual_scale_;
};

}  // namespace asyncserve
