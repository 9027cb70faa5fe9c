// Python bindings of the native CPU kernels (one translation unit: torch's headers are slow to
// compile). Each op checks shapes, dtypes and every index it will follow; the bindings release the
// GIL around the whole call, so the ops also run inside the decoder's layer loop (decoder.h).
#include <limits>

#include <torch/extension.h>

#include "activation.h"
#include "attention.h"
#include "gemm.h"
#include "lora.h"
#include "norm.h"
#include "prefill_attention.h"
#include "quant.h"
#include "rope_kv.h"
#include "sampling.h"

namespace asyncserve {
namespace {

template <typename F>
void dispatch_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else if (t.scalar_type() == at::kBFloat16) {
    f(bf16{});
  } else {
    TORCH_CHECK(false, "native kernels take float32 or bfloat16, got ", t.scalar_type());
  }
}

void check_like(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " has dtype ", t.scalar_type(), ", expected ",
              like.scalar_type());
  TORCH_CHECK(t.stride(-1) == 1, name, "'s last dimension must be contiguous");
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(), name,
              " must be a contiguous int64 CPU tensor");
}

// A norm weight of x's dtype (torch's rms_norm) or float32 (Gemma's (1 + w)): f(T, W) for its type W.
template <typename T, typename F>
void dispatch_norm_weight(const at::Tensor& weight, const at::Tensor& x, const char* name, F&& f) {
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.dim() == 1, name,
              " must be a contiguous one-dimensional CPU tensor");
  if (weight.scalar_type() == x.scalar_type()) {
    f(weight.data_ptr<T>());
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kFloat, name, " has dtype ", weight.scalar_type(), ", expected ",
                x.scalar_type(), " or float32");
    f(weight.data_ptr<float>());
  }
}

// h: [rows, hidden]; delta: like h or None; weight: [hidden], h's dtype or float32 (norm.h). Adds
// delta into h (in place) when given; returns rms_norm(h) * weight as a new [rows, hidden] tensor.
at::Tensor add_rms_norm_op(at::Tensor h, c10::optional<at::Tensor> delta, at::Tensor weight, double eps) {
  check_like(h, h, "h");
  TORCH_CHECK(h.dim() == 2, "h must be [rows, hidden]");
  const int64_t rows = h.size(0), hidden = h.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, "weight must be [hidden]");
  if (delta) {
    check_like(*delta, h, "delta");
    TORCH_CHECK(delta->sizes() == h.sizes(), "delta must have h's shape");
  }
  at::Tensor out = at::empty({rows, hidden}, h.options());
  dispatch_dtype(h, [&](auto zero) {
    using T = decltype(zero);
    dispatch_norm_weight<T>(weight, h, "weight", [&](auto* w) {
      add_rms_norm(h.data_ptr<T>(), h.stride(0), delta ? delta->data_ptr<T>() : nullptr,
                   delta ? delta->stride(0) : 0, w, out.data_ptr<T>(), hidden, rows, hidden, float(eps));
    });
  });
  return out;
}

// qkv: [tokens, (nh + 2 nkv) hd]; q_weight, k_weight: [hd], qkv's dtype or float32 (both the same).
// Norms each q head with q_weight and each k head with k_weight, in place.
void head_rms_norm_op(at::Tensor qkv, at::Tensor q_weight, at::Tensor k_weight, int64_t nh, int64_t nkv, double eps) {
  check_like(qkv, qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && nh > 0 && nkv > 0 && qkv.size(1) % (nh + 2 * nkv) == 0,
              "qkv must be [tokens, (nh + 2 nkv) * hd]");
  const int64_t hd = qkv.size(1) / (nh + 2 * nkv);
  const bool whole = q_weight.numel() == nh * hd && k_weight.numel() == nkv * hd && nh * nkv > 1;
  TORCH_CHECK((whole || (q_weight.numel() == hd && k_weight.numel() == hd)) && k_weight.dim() == 1 &&
                  k_weight.is_contiguous() && k_weight.device().is_cpu() && k_weight.scalar_type() == q_weight.scalar_type(),
              "q_weight and k_weight must be contiguous CPU tensors of one dtype, [head_dim] each (per head) or "
              "[nh * head_dim] and [nkv * head_dim] (q and k whole)");
  const int64_t nq = whole ? 1 : nh, nk = whole ? 1 : nkv;
  dispatch_dtype(qkv, [&](auto zero) {
    using T = decltype(zero);
    dispatch_norm_weight<T>(q_weight, qkv, "q_weight", [&](auto* q_w) {
      using W = std::remove_pointer_t<decltype(q_w)>;
      head_rms_norm(qkv.data_ptr<T>(), qkv.stride(0), q_w, k_weight.data_ptr<W>(), qkv.size(0), nq, nh * hd / nq,
                    nk, nkv * hd / nk, float(eps));
    });
  });
}

// gate_up: [rows, 2 * inter]; returns Act(gate) * up as a new [rows, inter] tensor (activation.h).
template <float (*Act)(float)>
at::Tensor gated_mul_op(at::Tensor gate_up) {
  check_like(gate_up, gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  dispatch_dtype(gate_up, [&](auto zero) {
    using T = decltype(zero);
    gated_mul<T, Act>(gate_up.data_ptr<T>(), gate_up.stride(0), out.data_ptr<T>(), inter, rows, inter);
  });
  return out;
}

// logits: [rows, vocab]; returns (tokens int64 [rows], finite bool [rows]): torch's argmax per row
// and whether the logit it picks is finite.
std::tuple<at::Tensor, at::Tensor> greedy_rows_op(at::Tensor logits) {
  check_like(logits, logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, vocab] with vocab >= 1");
  const int64_t rows = logits.size(0);
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor finite = at::empty({rows}, logits.options().dtype(at::kBool));
  dispatch_dtype(logits, [&](auto zero) {
    using T = decltype(zero);
    greedy_rows<T>(logits.data_ptr<T>(), logits.stride(0), rows, logits.size(1), tokens.data_ptr<int64_t>(),
                   finite.data_ptr<bool>());
  });
  return {tokens, finite};
}

// qkv: [tokens, (nh + 2 nkv) hd], rotated in place; positions, write_rows: [tokens];
// cos, sin: [max_pos, rot], rot <= hd the dimensions rotated; kv_rows: [rows, nkv hd], the pool's KV rows.
void rope_write_kv_op(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv_rows,
                      at::Tensor write_rows, int64_t k_offset, int64_t v_offset, int64_t nh, int64_t nkv) {
  check_like(qkv, qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && nh > 0 && nkv > 0 && qkv.size(1) % (nh + 2 * nkv) == 0,
              "qkv must be [tokens, (nh + 2 nkv) * hd]");
  const int64_t tokens = qkv.size(0), hd = qkv.size(1) / (nh + 2 * nkv);
  TORCH_CHECK(hd % 2 == 0, "head_dim must be even");
  check_like(cos, qkv, "cos");
  check_like(sin, qkv, "sin");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) <= hd && cos.size(1) % 2 == 0 && sin.sizes() == cos.sizes() &&
              sin.strides() == cos.strides(), "cos and sin must be [max_pos, rot] (rot even, at most head_dim) with the same strides");
  check_like(kv_rows, qkv, "kv_rows");
  TORCH_CHECK(kv_rows.dim() == 2 && kv_rows.size(1) == nkv * hd && kv_rows.is_contiguous(),
              "kv_rows must be contiguous [rows, nkv * head_dim]");
  check_index(positions, "positions");
  check_index(write_rows, "write_rows");
  TORCH_CHECK(positions.numel() == tokens && write_rows.numel() == tokens, "one position and write row per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* rows = write_rows.data_ptr<int64_t>();
  const int64_t lo = std::min(k_offset, v_offset), hi = std::max(k_offset, v_offset);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the RoPE table");
    TORCH_CHECK(rows[t] + lo >= 0 && rows[t] + hi < kv_rows.size(0), "KV row ", rows[t], " outside the pool");
  }
  dispatch_dtype(qkv, [&](auto zero) {
    using T = decltype(zero);
    rope_write_kv<T>(qkv.data_ptr<T>(), qkv.stride(0), pos, cos.data_ptr<T>(), sin.data_ptr<T>(), cos.stride(0),
                     kv_rows.data_ptr<T>(), rows, k_offset, v_offset, tokens, nh, nkv, hd, cos.size(1));
  });
}

// out, q: [n, nh, hd]; k_cache, v_cache: [pages, block, nkv * hd] (one layer, any page and slot
// strides); tables: [n, max_pages] page ids; context_lens: [n]; window: 0, or each query's sliding
// window; softcap: 0, or the scores' soft cap. Writes attention into out.
void paged_decode_attention_op(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                               at::Tensor context_lens, double scale, int64_t window, double softcap) {
  check_like(q, q, "q");
  check_like(out, q, "out");
  check_like(k_cache, q, "k_cache");
  check_like(v_cache, q, "v_cache");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [n, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              "k_cache and v_cache must be [pages, block, kv_size] with the same strides");
  const DecodeAttentionShape s{q.size(0), q.size(1), k_cache.size(2) / q.size(2), q.size(2), k_cache.size(1)};
  TORCH_CHECK(s.nkv > 0 && k_cache.size(2) == s.nkv * s.hd && s.nh % s.nkv == 0,
              "num_heads must be a multiple of the cache's KV heads");
  check_index(tables, "tables");
  check_index(context_lens, "context_lens");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be 0 (none) or positive");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == s.n && context_lens.numel() == s.n,
              "tables must be [n, max_pages] and context_lens [n]");
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t width = tables.size(1), pages = k_cache.size(0);
  for (int64_t i = 0; i < s.n; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= width * s.block, "context length ", lens[i], " does not fit the block table");
    for (int64_t p = 0; p < (lens[i] + s.block - 1) / s.block; ++p)
      TORCH_CHECK(table[i * width + p] >= 0 && table[i * width + p] < pages, "page ", table[i * width + p],
                  " outside the pool");
  }
  dispatch_dtype(q, [&](auto zero) {
    using T = decltype(zero);
    paged_decode_attention<T>(out.data_ptr<T>(), out.stride(0), out.stride(1), q.data_ptr<T>(), q.stride(0),
                              q.stride(1), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.stride(0),
                              k_cache.stride(1), table, width, lens, s, float(scale), window, float(softcap));
  });
}

// out, q: [tokens, nh, hd]; k_cache, v_cache as for decode; tables: [chunks, max_pages] page ids;
// query_starts: [chunks + 1], chunk i's rows of q and out; first_pos: [chunks], the position of each
// chunk's first row. Each row attends causally to its sequence's keys (the chunk's own K/V already
// in the pool), within its sliding window where window > 0, scores soft-capped where softcap > 0.
// Rows of out outside the chunks are left as they are.
void paged_prefill_attention_op(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                at::Tensor tables, at::Tensor query_starts, at::Tensor first_pos, double scale,
                                int64_t window, double softcap) {
  check_like(q, q, "q");
  check_like(out, q, "out");
  check_like(k_cache, q, "k_cache");
  check_like(v_cache, q, "v_cache");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [tokens, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              "k_cache and v_cache must be [pages, block, kv_size] with the same strides");
  const PrefillAttentionShape s{q.size(1), k_cache.size(2) / q.size(2), q.size(2), k_cache.size(1)};
  TORCH_CHECK(s.nkv > 0 && k_cache.size(2) == s.nkv * s.hd && s.nh % s.nkv == 0,
              "num_heads must be a multiple of the cache's KV heads");
  TORCH_CHECK(s.hd % 2 == 0, "head_dim must be even");     // bf16 runs as pairs of dimensions
  check_index(tables, "tables");
  check_index(query_starts, "query_starts");
  check_index(first_pos, "first_pos");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be 0 (none) or positive");
  const int64_t chunks = first_pos.numel();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == chunks && query_starts.numel() == chunks + 1,
              "tables must be [chunks, max_pages], query_starts [chunks + 1] and first_pos [chunks]");
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* pos = first_pos.data_ptr<int64_t>();
  const int64_t width = tables.size(1), pages = k_cache.size(0);
  TORCH_CHECK(chunks == 0 || (starts[0] >= 0 && starts[chunks] <= q.size(0)), "query rows outside q");
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t keys = pos[i] + starts[i + 1] - starts[i];
    TORCH_CHECK(starts[i + 1] >= starts[i] && pos[i] >= 0, "chunk ", i, " has a negative length or position");
    TORCH_CHECK(keys <= width * s.block, "context length ", keys, " does not fit the block table");
    for (int64_t p = 0; p < (keys + s.block - 1) / s.block; ++p)
      TORCH_CHECK(table[i * width + p] >= 0 && table[i * width + p] < pages, "page ", table[i * width + p],
                  " outside the pool");
  }
  dispatch_dtype(q, [&](auto zero) {
    using T = decltype(zero);
    paged_prefill_attention<T>(out.data_ptr<T>(), out.stride(0), out.stride(1), q.data_ptr<T>(), q.stride(0),
                               q.stride(1), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.stride(0),
                               k_cache.stride(1), table, width, starts, pos, chunks, s, float(scale), window,
                               float(softcap));
  });
}

struct CheckedLora {
  LoraTables tables;
  const LoraRun* runs;
  int64_t num_runs;
  const LoraProjection* projs;
  int64_t num_projs, fan_in;
};

// lora_segments' arguments checked: every index it will follow inside its tensor.
CheckedLora check_lora(const at::Tensor& y, const at::Tensor& x, const at::Tensor& flat, const at::Tensor& runs,
                       const at::Tensor& ranks, const at::Tensor& a_ptr, const at::Tensor& b_ptr,
                       const at::Tensor& scaling, int64_t layer, const at::Tensor& projections) {
  check_like(x, x, "x");
  check_like(y, x, "y");
  check_like(flat, x, "flat");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && y.size(0) == x.size(0), "x and y must be [tokens, features]");
  TORCH_CHECK(flat.dim() == 1, "flat must be the pool's one-dimensional view");
  check_index(runs, "runs");
  check_index(a_ptr, "a_ptr");
  check_index(b_ptr, "b_ptr");
  check_index(projections, "projections");
  TORCH_CHECK(ranks.device().is_cpu() && ranks.scalar_type() == at::kInt && ranks.is_contiguous(),
              "ranks must be a contiguous int32 CPU tensor");
  TORCH_CHECK(scaling.device().is_cpu() && scaling.scalar_type() == at::kFloat && scaling.is_contiguous(),
              "scaling must be a contiguous float32 CPU tensor");
  TORCH_CHECK(a_ptr.dim() == 4 && b_ptr.sizes() == a_ptr.sizes(), "a_ptr and b_ptr must be [adapters, layers, P, R]");
  const int64_t n = a_ptr.size(0), P = a_ptr.size(2);
  const LoraTables tables{ranks.data_ptr<int32_t>(), a_ptr.data_ptr<int64_t>(), b_ptr.data_ptr<int64_t>(),
                          scaling.data_ptr<float>(), a_ptr.size(1), P, a_ptr.size(3), layer};
  TORCH_CHECK(ranks.dim() == 2 && ranks.size(0) == n && ranks.size(1) == P, "ranks must be [adapters, P]");
  TORCH_CHECK(scaling.dim() == 3 && scaling.size(0) == n && scaling.size(1) == tables.layers && scaling.size(2) == P,
              "scaling must be [adapters, layers, P]");
  TORCH_CHECK(layer >= 0 && layer < tables.layers, "layer ", layer, " outside the tables");
  TORCH_CHECK(runs.dim() == 2 && runs.size(1) == 3, "runs must be [num_runs, 3]");
  TORCH_CHECK(projections.dim() == 2 && projections.size(1) == 3, "projections must be [num_projs, 3]");
  const auto* run = reinterpret_cast<const LoraRun*>(runs.data_ptr<int64_t>());
  const auto* proj = reinterpret_cast<const LoraProjection*>(projections.data_ptr<int64_t>());
  const int64_t fan_in = x.size(1), limit = flat.numel();
  for (int64_t p = 0; p < projections.size(0); ++p)
    TORCH_CHECK(proj[p].index >= 0 && proj[p].index < P && proj[p].column >= 0 && proj[p].fan_out > 0 &&
                    proj[p].column + proj[p].fan_out <= y.size(1),
                "projection ", p, " outside the tables or y");
  for (int64_t i = 0; i < runs.size(0); ++i) {
    TORCH_CHECK(run[i].begin >= 0 && run[i].begin <= run[i].end && run[i].end <= x.size(0) &&
                    (i == 0 || run[i].begin >= run[i - 1].end),
                "runs must be ordered token ranges inside x");
    TORCH_CHECK(run[i].adapter >= 0 && run[i].adapter < n, "run adapter ", run[i].adapter, " outside the tables");
    for (int64_t p = 0; p < projections.size(0); ++p) {
      const int64_t r = tables.rank(run[i].adapter, proj[p].index);
      TORCH_CHECK(r >= 0 && r <= tables.max_rank, "rank ", r, " outside the tables");
      const int64_t* a = tables.a_rows(run[i].adapter, proj[p].index);
      const int64_t* b = tables.b_rows(run[i].adapter, proj[p].index);
      for (int64_t j = 0; j < r; ++j)
        TORCH_CHECK(a[j] >= 0 && a[j] + fan_in <= limit && b[j] >= 0 && b[j] + proj[p].fan_out <= limit,
                    "adapter row outside the pool");
    }
  }
  return {tables, run, runs.size(0), proj, projections.size(0), fan_in};
}

// y: [tokens, out] (the group's output, updated in place), x: [tokens, fan_in]; flat: the pool,
// one dimension; runs: [num_runs, 3] (first token, end token, step adapter); ranks [n, P] int32,
// a_ptr, b_ptr [n, L, P, R] int64, scaling [n, L, P] float32: the step's tables; projections:
// [num_projs, 3] (index in the tables, first column in y, width). Adds each run's LoRA into y.
void lora_segments_op(at::Tensor y, at::Tensor x, at::Tensor flat, at::Tensor runs, at::Tensor ranks, at::Tensor a_ptr,
                      at::Tensor b_ptr, at::Tensor scaling, int64_t layer, at::Tensor projections) {
  const CheckedLora c = check_lora(y, x, flat, runs, ranks, a_ptr, b_ptr, scaling, layer, projections);
  dispatch_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    lora_segments<T>(y.data_ptr<T>(), y.stride(0), x.data_ptr<T>(), x.stride(0), c.fan_in, flat.data_ptr<T>(),
                     c.tables, c.runs, c.num_runs, c.projs, c.num_projs);
  });
}

// What a GEMM handed lora_segments' rows for these arguments asks for (decoder.h, gemm.h's
// SideStream), as `parts` threads split it: per part, its cache lines' byte offsets from flat's
// first element, in the order asked.
std::vector<at::Tensor> lora_prefetch_lines_op(at::Tensor y, at::Tensor x, at::Tensor flat, at::Tensor runs,
                                               at::Tensor ranks, at::Tensor a_ptr, at::Tensor b_ptr,
                                               at::Tensor scaling, int64_t layer, at::Tensor projections,
                                               int64_t parts) {
  const CheckedLora c = check_lora(y, x, flat, runs, ranks, a_ptr, b_ptr, scaling, layer, projections);
  TORCH_CHECK(parts > 0, "parts must be positive");
  std::vector<PrefetchSpan> spans;
  dispatch_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    spans = lora_spans(flat.data_ptr<T>(), c.tables, c.runs, c.num_runs, c.projs, c.num_projs, c.fan_in);
  });
  const int64_t lines = SideStream::total_lines(&spans);
  const char* base = static_cast<const char*>(flat.data_ptr());
  std::vector<at::Tensor> out;
  for (int64_t part = 0; part < parts; ++part) {
    std::vector<int64_t> offsets;
    for (SideStream s = SideStream::share(&spans, lines, part, part + 1, parts); s.line(); s.advance())
      offsets.push_back(s.line() - base);
    out.push_back(torch::tensor(offsets, at::kLong));
  }
  return out;
}

// x: [M, K] bf16 (K even) or float32; packed: linear.py's NativeLinear.pack of W [N, K], [ceil(N / 16),
// K / 2, 16, 2] bf16 or [ceil(N / 16), K, 16, 1] float32: 16 output columns per block, one 32-bit lane
// of a k-pair (bf16) or one k (fp32) per column. Returns x W^T as a new [M, N] tensor of x's dtype. Only
// where the build has that dtype's GEMM (kBf16Gemm, kFp32Gemm). side: spans for the GEMM to ask for
// as it computes (gemm.h, SideStream), or null.
at::Tensor packed_linear_op(at::Tensor x, at::Tensor packed, int64_t out_features,
                            const std::vector<PrefetchSpan>* side = nullptr) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2,
              "x must be a [rows, in_features] bfloat16 or float32 CPU tensor");
  TORCH_CHECK(bf16 ? kBf16Gemm : kFp32Gemm, "this build has no packed ", bf16 ? "bf16 (AVX512-BF16)" : "fp32 (AVX2)",
              " GEMM (bf16_gemm_available() / fp32_gemm_available() is False)");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = out_features, per_lane = bf16 ? 2 : 1;
  TORCH_CHECK(K % per_lane == 0, "in_features must be even, got ", K);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == x.scalar_type() && packed.is_contiguous() &&
                  packed.dim() == 4 && packed.size(1) == K / per_lane && packed.size(2) == 16 &&
                  packed.size(3) == per_lane,
              "packed must be a contiguous [blocks, ", K / per_lane, ", 16, ", per_lane, "] tensor of x's dtype");
  TORCH_CHECK(N > 0 && packed.size(0) == (N + 15) / 16, "packed holds ", packed.size(0),
              " blocks of 16 columns, not the ", (N + 15) / 16, " that ", N, " outputs need");
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0) return y;
#if ASYNCSERVE_BF16_GEMM
  if (bf16)
    packed_linear_bf16(reinterpret_cast<const uint16_t*>(xc.data_ptr()), M, K / 2,
                       reinterpret_cast<const uint16_t*>(packed.data_ptr()), packed.size(0),
                       reinterpret_cast<uint16_t*>(y.data_ptr()), N, side);
#endif
#if ASYNCSERVE_FP32_GEMM
  if (!bf16)
    packed_linear_fp32(xc.data_ptr<float>(), M, K, packed.data_ptr<float>(), packed.size(0), y.data_ptr<float>(), N,
                       side);
#endif
  return y;
}


// x: [M, K] float32 or bf16; parts: each one weight's [out_i, K / block * bytes] uint8 rows of GGUF
// blocks of types[i] (quant.h's formats), stacked as output columns in order. Returns x W^T as a new
// [M, sum out_i] tensor of x's dtype.
at::Tensor quant_linear_op(at::Tensor x, std::vector<at::Tensor> parts, std::vector<int64_t> types) {
  check_like(x, x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "one type per part, at least one part");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<QuantPart> checked;
  int64_t N = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const QuantFormat f = part_format(types[i]);
    TORCH_CHECK(f.block > 0, "ggml type ", types[i], " has no quantized kernel (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)");
    TORCH_CHECK(!panel_type(types[i]) || (ASYNCSERVE_QUANT_PANEL && parts[i].size(0) % 8 == 0),
                "panels (part ", i, ") need a build that runs panels and a multiple of 8 rows");
    TORCH_CHECK(K % f.block == 0, "in_features ", K, " is not a multiple of type ", types[i], "'s ", f.block,
                "-weight blocks");
    const at::Tensor& p = parts[i];
    TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == at::kByte && p.is_contiguous() && p.dim() == 2 &&
                    p.size(0) > 0 && p.size(1) == K / f.block * f.bytes,
                "part ", i, " must be a contiguous uint8 [out, ", K / f.block * f.bytes, "] tensor");
    checked.push_back({p.data_ptr<uint8_t>(), types[i], p.size(0), p.size(1), N});
    N += p.size(0);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  dispatch_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    quant_linear<T>(x.data_ptr<T>(), x.stride(0), M, K, checked, y.data_ptr<T>(), N);
  });
  return y;
}

// blocks: one weight's [out, K / block * bytes] uint8 rows (out % 8 == 0) of ggml type Q4_0, Q4_1, Q4_K, Q5_K
// or Q6_K -> its panels (quant.h's kQ4_0_Panels .. kQ6_K_Panels), [out, K / block * panel bytes / 8] uint8; or,
// given panels and their type, back to the blocks (to_panels false), bit for bit; into `out` where given.
at::Tensor panels_op(at::Tensor blocks, int64_t type, int64_t in_features, bool to_panels, c10::optional<at::Tensor> out_given) {
  const int64_t K = in_features, block_type = to_panels ? type : type - 0x100;
  TORCH_CHECK(has_panels(block_type) && (to_panels || panel_type(type)),
              "type ", type, " has no panels (Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)");
  const int64_t panel = to_panels ? type + 0x100 : type, block = quant_format(block_type).block;
  const int64_t from = part_format(to_panels ? type : panel).bytes, to = part_format(to_panels ? panel : block_type).bytes;
  TORCH_CHECK(K > 0 && K % block == 0, "in_features ", K, " is not a multiple of the ", block, "-weight blocks");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.dim() == 2 && blocks.size(0) % 8 == 0 && blocks.size(1) == K / block * from,
              "blocks must be a contiguous uint8 [a multiple of 8 rows, ", K / block * from, "] tensor");
  at::Tensor out = out_given.has_value() ? *out_given : at::empty({blocks.size(0), K / block * to}, blocks.options());
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kByte && out.is_contiguous() &&
                  out.sizes() == at::IntArrayRef({blocks.size(0), K / block * to}) && !out.is_same(blocks),
              "out must be a contiguous uint8 [", blocks.size(0), ", ", K / block * to, "] tensor apart from blocks");
  uint8_t* in = blocks.data_ptr<uint8_t>();   // read only
  uint8_t* o = out.data_ptr<uint8_t>();
  repack_panels(block_type, to_panels ? in : o, blocks.size(0), K, to_panels ? o : in, to_panels);
  return out;
}

// out: [n, K] float32 or bf16, rows ids [n] (int64) of blocks, one weight's [rows, K / block * bytes] uint8
// GGUF blocks of ggml type `type`, dequantized (quant_rows).
void quant_rows_op(at::Tensor out, at::Tensor blocks, int64_t type, at::Tensor ids) {
  check_like(out, out, "out");
  check_index(ids, "ids");
  const QuantFormat f = part_format(type);
  TORCH_CHECK(f.block > 0, "ggml type ", type, " has no quantized kernel (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)");
  TORCH_CHECK(!panel_type(type) || blocks.size(0) % 8 == 0, "panels need a multiple of 8 rows");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.numel() && out.size(1) % f.block == 0,
              "out must be a contiguous [ids, a multiple of ", f.block, "] tensor");
  const int64_t n = ids.numel(), K = out.size(1), rows = blocks.size(0);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.dim() == 2 && blocks.size(1) == K / f.block * f.bytes,
              "blocks must be a contiguous uint8 [rows, ", K / f.block * f.bytes, "] tensor");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "index ", id[i], " is out of range for ", rows, " rows");
  if (n == 0) return;
  dispatch_dtype(out, [&](auto zero) {
    using T = decltype(zero);
    quant_rows<T>(blocks.data_ptr<uint8_t>(), type, blocks.size(1), K, id, n, out.data_ptr<T>());
  });
}

}  // namespace
}  // namespace asyncserve

#include "decoder.h"
#include "experts.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace asyncserve;
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("add_rms_norm", &add_rms_norm_op, no_gil, "h += delta (if given); returns rms_norm(h) * weight");
  m.def("head_rms_norm", &head_rms_norm_op, no_gil, "RMSNorm of qkv's q and k per head or whole, in place");
  m.def("silu_mul", &gated_mul_op<silu>, no_gil, "silu(gate) * up of gate_up = [gate, up]");
  m.def("gelu_tanh_mul", &gated_mul_op<gelu_tanh>, no_gil, "gelu_tanh(gate) * up of gate_up = [gate, up]");
  m.def("greedy_rows", &greedy_rows_op, no_gil, "argmax per row (torch's ties and NaN) and its finiteness");
  m.def("rope_write_kv", &rope_write_kv_op, no_gil, "RoPE on q and k in place; k and v into the pool");
  m.def("paged_decode_attention", &paged_decode_attention_op, no_gil, "decode attention over block tables");
  m.def("paged_prefill_attention", &paged_prefill_attention_op, no_gil,
        "prefill chunks' causal attention over block tables");
  m.def("packed_linear", [](at::Tensor x, at::Tensor packed, int64_t out) { return packed_linear_op(x, packed, out); },
        no_gil, "x W^T over a weight packed by NativeLinear (bf16 or float32)");
  m.def("bf16_gemm_available", [] { return kBf16Gemm; }, "whether packed_linear runs bf16 on this build");
  m.def("fp32_gemm_available", [] { return kFp32Gemm; }, "whether packed_linear runs float32 on this build");
#if ASYNCSERVE_AMX_GEMM
  m.def("amx_gemm_available", [] { return amx_permitted(); }, "whether packed_linear's AMX tiles run here");
#else
  m.def("amx_gemm_available", [] { return false; }, "whether packed_linear's AMX tiles run here");
#endif
  m.def("set_amx_gemm", [](bool on) { return amx_gemm_on.exchange(on); },
        "whether packed_linear may run AMX tiles (on at start); returns the previous setting");
  m.def("quant_linear", &quant_linear_op, no_gil, "x W^T over weights in GGUF blocks (quant.h)");
  m.def("quant_rows", &quant_rows_op, no_gil, "rows of a weight in GGUF blocks, dequantized (quant.h)");
  m.def("set_quant_fused_rows", [](int64_t rows) { return quant_fused_rows.exchange(rows); },
        "the most rows quant_linear's int8 strategy runs its fused kernels for (quant.h); returns the previous setting");
  m.def("set_quant_int8", [](bool on) { return quant_int8_on.exchange(on); },
        "whether quant_linear quantizes x to int8 (on at start) or runs fp32 x against fp32-dequantized columns");
  m.def("set_quant_panel_rows", [](int64_t rows) { return quant_panel_rows.exchange(rows); },
        "rows from which quant_linear's int8 strategy runs panels of 8 columns (quant.h); returns the previous setting");
  m.def("set_quant_q5k_decoded_rows", [](int64_t rows) { return quant_q5k_decoded_rows.exchange(rows); },
        "rows from which quant_linear decodes a Q5_K panel once per call, not per tile (quant.h); returns the previous setting");
  m.def("set_quant_amx_rows", [](int64_t rows) { return quant_amx_rows.exchange(rows); },
        "rows from which quant_linear runs Q4_K, Q5_K and Q6_K panels on AMX tiles (quant_amx.h); returns the previous setting");
  m.def("quant_amx_available", [] { return quant_amx_runs(std::numeric_limits<int64_t>::max()); },
        "whether quant_linear has AMX tiles here (the build and the process's tile state)");
  m.def("quant_panels", [] { return bool(ASYNCSERVE_QUANT_PANEL); }, "whether quant_linear runs panels on this build");
  m.def("panels", &panels_op, no_gil, "Q4_0, Q4_1, Q4_K, Q5_K or Q6_K blocks repacked into panels of 8 columns, or back (quant.h)",
        py::arg("blocks"), py::arg("type"), py::arg("in_features"), py::arg("to_panels"), py::arg("out") = py::none());
  m.def("panel_types", [] { return std::vector<int64_t>{kQ4_0_Panels, kQ4_1_Panels, kQ4_K_Panels, kQ5_K_Panels, kQ6_K_Panels}; },
        "the type ids quant_linear takes for Q4_0, Q4_1, Q4_K, Q5_K and Q6_K in panels");
  m.def("quant_path", [] { return std::string(quant_path()); }, "the integer dot products quant_linear runs here");
  m.def("lora_segments", &lora_segments_op, no_gil, "y += each run's LoRA, read from the pool rows");
  m.def("lora_prefetch_lines", &lora_prefetch_lines_op, "the lines a GEMM asks for ahead of lora_segments, by thread");
  m.def("set_lora_rows_ahead", [](bool on) { return lora_rows_ahead_on.exchange(on); },
        "whether the native decoder's GEMMs ask for the next LoRA call's rows (on at start); returns the previous setting");
  py::class_<NativeDecoder>(m, "NativeDecoder", py::module_local())   // local: another build may load beside it
      .def(py::init<std::vector<c10::optional<at::Tensor>>, std::vector<std::vector<at::Tensor>>,
                    std::vector<std::vector<int64_t>>, std::vector<int64_t>, std::vector<int64_t>, std::vector<bool>,
                    at::Tensor, int64_t,
                    int64_t, int64_t, double, double, double, bool, double>())
      .def("forward", &NativeDecoder::forward, no_gil, "the layers, final norm and lm_head of one step");
  py::class_<NativeExperts>(m, "NativeExperts", py::module_local())
      .def(py::init<std::vector<std::vector<at::Tensor>>, std::vector<std::vector<int64_t>>, std::vector<int64_t>>())
      .def("forward", &NativeExperts::forward, no_gil, "one layer's mixture of experts for routed tokens")
      .def("forward_lora", &NativeExperts::forward_lora, no_gil, "the same with each token's LoRA on the experts");
}
