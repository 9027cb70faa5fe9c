"""Llama-family decoder as plain functions over a flat batch of tokens (gpt-fast style).

A step's tokens from many sequences are concatenated: decode tokens first (one per sequence), then
prefill chunks. Base projections run once for all tokens; the LoRA part is added per projection
group by the batched-LoRA backend. KV lives in the unified pool's pages (pager/pool.py).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncserve.lora.backend import LoraBackend
from asyncserve.model.config import ModelConfig
from asyncserve.model.linear import Linear, make_linear


# Projections are Linear objects over the checkpoint's [out, in] weights (model/linear.py picks
# the fastest kernel and memory layout for the device).
@dataclass
class LayerWeights:
    input_norm: torch.Tensor   # [hidden]
    qkv: Linear                # hidden -> q + 2 kv
    o: Linear                  # q -> hidden
    post_norm: torch.Tensor    # [hidden]
    gate_up: Linear            # hidden -> 2 inter
    down: Linear               # inter -> hidden


@dataclass
class LlamaWeights:
    embed: torch.Tensor        # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor         # [hidden]
    lm_head: Linear            # hidden -> vocab (over the embedding itself when tied, unless reordered)

    def nbytes(self) -> int:
        tensors = [self.embed, self.norm] + [t for lw in self.layers for t in (lw.input_norm, lw.post_norm)]
        linears = [self.lm_head] + [p for lw in self.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        shared = self.lm_head.weight is self.embed
        return (sum(t.numel() * t.element_size() for t in tensors)
                + sum(p.nbytes for p in linears) - (self.lm_head.nbytes if shared else 0))


def build_weights(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                  device: torch.device) -> LlamaWeights:
    """Fuse q/k/v and gate/up, cast and move; consumes ``weights`` to keep peak memory low."""
    def take(name: str) -> torch.Tensor:
        try:
            return weights.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint is missing tensor {name!r}") from None

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        layers.append(LayerWeights(
            input_norm=put(take(p + "input_layernorm.weight")),
            qkv=make_linear(put(qkv)),
            o=make_linear(put(take(p + "self_attn.o_proj.weight"))),
            post_norm=put(take(p + "post_attention_layernorm.weight")),
            gate_up=make_linear(put(gate_up)),
            down=make_linear(put(take(p + "mlp.down_proj.weight"))),
        ))
    embed = put(take("model.embed_tokens.weight"))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
        lm_head = make_linear(embed)
    else:
        lm_head = make_linear(put(take("lm_head.weight")))
    _check_shapes(config, embed, layers[0], lm_head)
    return LlamaWeights(embed=embed, layers=layers, norm=put(take("model.norm.weight")), lm_head=lm_head)


def _check_shapes(config: ModelConfig, embed: torch.Tensor, layer: LayerWeights, lm_head: Linear) -> None:
    h = config.hidden_size
    expected = {
        "embed_tokens": (tuple(embed.shape), (config.vocab_size, h)),
        "q/k/v_proj": (layer.qkv.shape, (config.q_size + 2 * config.kv_size, h)),
        "o_proj": (layer.o.shape, (h, config.q_size)),
        "gate/up_proj": (layer.gate_up.shape, (2 * config.intermediate_size, h)),
        "down_proj": (layer.down.shape, (h, config.intermediate_size)),
        "lm_head": (lm_head.shape, (config.vocab_size, h)),
    }
    for name, (shape, want) in expected.items():
        if shape != want:
            raise ValueError(f"{name} has shape {shape}, the config implies {want}")


# ---- rotary embeddings ---------------------------------------------------------------------------

def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling factor for the config's RoPE."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    attn_factor = 1.0
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / factor,
                               torch.where(wavelen < high_wavelen, inv_freq, blended))
    else:
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    return inv_freq.float(), attn_factor


class Rope:
    """cos/sin tables up to max_position, indexed per step by token positions."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype):
        inv_freq, self.attn_factor = rope_inv_freq(config)
        pos = torch.arange(config.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)                      # [max_pos, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)                 # [max_pos, hd]
        self.cos = (emb.cos() * self.attn_factor).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * self.attn_factor).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [tokens] -> cos, sin: [tokens, 1, hd]
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [tokens, heads, hd] (HF rotate-half convention, Q/K weights un-permuted)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ---- the step batch ------------------------------------------------------------------------------

@dataclass
class PrefillChunk:
    start: int                 # first token index in the step
    end: int
    first_pos: int             # position of the chunk's first token in its sequence
    block_table: torch.Tensor  # [pages] int64


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    write_rows: torch.Tensor       # [T] int64: row of the K entry of layer 0 in pool kv rows (see kv_rows)
    num_decode: int                # the first num_decode tokens are single-token decodes
    decode_pages: torch.Tensor     # [num_decode * max_pages] int64: block tables padded with page 0
    decode_mask: torch.Tensor      # [num_decode, 1, 1, max_pages * block] bool: True = attend
    prefills: list[PrefillChunk]
    sample_index: torch.Tensor     # [n_sample] int64: tokens whose next-token logits are needed


# ---- forward -------------------------------------------------------------------------------------

def forward(w: LlamaWeights, config: ModelConfig, rope: Rope, kv: torch.Tensor, inp: StepInputs,
            lora: LoraBackend) -> torch.Tensor:
    """Run all layers for the step's tokens; returns logits [n_sample, vocab] in the weights' dtype
    (the sampler upcasts them).

    kv: the pool's KV view [pages, 2, layers, block, kv_size].
    """
    T = inp.input_ids.shape[0]
    nh, nkv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    q_size, kv_size = config.q_size, config.kv_size
    eps = config.rms_norm_eps
    cos, sin = rope.tables(inp.positions)
    # kv_rows: [pages * 2 * layers * block, kv_size]; K of layer l at write_rows + l*block, V at + layers*block
    num_layers, block = kv.shape[2], kv.shape[3]
    kv_rows = kv.view(-1, kv_size)
    use_lora = lora.active

    decode_mask = inp.decode_mask
    if inp.num_decode and _bmm_decode(w.embed):      # once per step: the bmm path adds it as a bias
        decode_mask = torch.zeros(decode_mask.shape, dtype=w.embed.dtype, device=decode_mask.device
                                  ).masked_fill_(~decode_mask, float("-inf")).view(inp.num_decode, 1, -1)
    h = F.embedding(inp.input_ids, w.embed)                       # [T, hidden]
    for li, lw in enumerate(w.layers):
        x = F.rms_norm(h, (h.shape[-1],), lw.input_norm, eps)
        qkv = lw.qkv(x)                                          # [T, q + 2kv]
        if use_lora:
            lora.apply(li, "qkv", x, qkv)
        qk = apply_rope(qkv[:, :q_size + kv_size].view(T, nh + nkv, hd), cos, sin)
        q, k = qk[:, :nh], qk[:, nh:]                              # [T, nh, hd], [T, nkv, hd]
        v = qkv[:, q_size + kv_size:]
        k_row = inp.write_rows + li * block
        kv_rows.index_copy_(0, k_row, k.reshape(T, kv_size))
        kv_rows.index_copy_(0, k_row + num_layers * block, v)
        attn = attention(q, k, v.view(T, nkv, hd), kv[:, 0, li], kv[:, 1, li], inp, decode_mask)   # [T, q]
        o = lw.o(attn)
        if use_lora:
            lora.apply(li, "o", attn, o)
        h = h + o
        x = F.rms_norm(h, (h.shape[-1],), lw.post_norm, eps)
        gu = lw.gate_up(x)                                       # [T, 2 inter]
        if use_lora:
            lora.apply(li, "gate_up", x, gu)
        gate, up = gu.chunk(2, dim=-1)
        act = F.silu(gate) * up
        d = lw.down(act)
        if use_lora:
            lora.apply(li, "down", act, d)
        h = h + d
    hs = F.rms_norm(h[inp.sample_index], (h.shape[-1],), w.norm, eps)
    return w.lm_head(hs)


def _gather_context(cache: torch.Tensor, pages: torch.Tensor, n: int, nkv: int, hd: int) -> torch.Tensor:
    """cache: [pool pages, block, kv_size] of one layer; pages: [n * p] -> [n, nkv, p * block, hd] (a view)."""
    return cache.index_select(0, pages).view(n, -1, nkv, hd).transpose(1, 2)


def _bmm_decode(x: torch.Tensor) -> bool:
    """Whether decode attention for tensors like ``x`` runs as the block-diagonal bmm's below."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16


@functools.lru_cache(maxsize=8)
def _query_blocks(nkv: int, hd: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, nkv, 1, nkv, 1]: the scaled identity that places each query in its KV head's columns."""
    return (torch.eye(nkv, dtype=dtype, device=device) * hd ** -0.5).view(1, nkv, 1, nkv, 1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """q: [n, nh, hd]; k_cache, v_cache: [pool pages, block, kv_size] of one layer; pages: [n * p] the
    block tables padded to p pages; mask: for SDPA [n, 1, 1, p * block] bool (True = attend), for the
    bmm path [n, 1, p * block] additive (0 or -inf) in q's dtype. Returns [n, nh, hd]."""
    n, nh, hd = q.shape
    kv_size = k_cache.shape[-1]
    nkv = kv_size // hd
    if not _bmm_decode(q):
        kc = _gather_context(k_cache, pages, n, nkv, hd)                    # [n, nkv, ctx, hd]
        vc = _gather_context(v_cache, pages, n, nkv, hd)
        return F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, attn_mask=mask, enable_gqa=True).squeeze(2)
    # On CPU, SDPA with one query row is 6x slower in bf16 than in fp32 (885 vs 154 us at 16 decodes,
    # 128 context, SmolLM2's heads; Zen5, 2 threads). Two bmm's over the gathered rows as they lie
    # ([n, ctx, nkv * hd]) take 125 us, and avoid the per-head copies of K and V that grouped
    # matmuls make (184 us): head h's query sits in the columns of its KV head h // group, zeros
    # elsewhere, and its output is that block of the product (3x the multiply-adds, a few M).
    group = nh // nkv
    k = k_cache.index_select(0, pages).view(n, -1, kv_size)                    # [n, ctx, nkv * hd]
    v = v_cache.index_select(0, pages).view(n, -1, kv_size)
    blocks = _query_blocks(nkv, hd, q.dtype, q.device)
    q_blocks = (q.view(n, nkv, group, 1, hd) * blocks).view(n, nh, kv_size)    # [n, nh, nkv * hd], scaled
    scores = torch.baddbmm(mask, q_blocks, k.transpose(1, 2))                   # [n, nh, ctx]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs, v).view(n, nkv, group, nkv, hd)      # [n, query's KV head, group, KV head, hd]
    return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(n, nh, hd)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              inp: StepInputs, decode_mask: torch.Tensor) -> torch.Tensor:
    """q: [T, nh, hd]; k, v: [T, nkv, hd] of this step (already written to the cache);
    k_cache, v_cache: [pages, block, kv_size] of this layer; decode_mask: as _decode_attention takes it.
    Returns [T, nh * hd]."""
    T, nh, hd = q.shape
    nkv = k.shape[1]
    out = torch.empty(T, nh, hd, dtype=q.dtype, device=q.device)
    nd = inp.num_decode
    if nd:
        # all decodes at once: gather their pages, padded to the longest context, mask the rest
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, inp.decode_pages, decode_mask)
    for chunk in inp.prefills:
        s, e = chunk.start, chunk.end
        qc = q[s:e].transpose(0, 1)                               # [nh, n, hd]
        if chunk.first_pos == 0:
            # the whole context is this chunk: attend to the fresh k/v, causal
            kc, vc = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
            oc = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
        else:
            ctx = chunk.first_pos + (e - s)
            kc = _gather_context(k_cache, chunk.block_table, 1, nkv, hd)[0, :, :ctx]
            vc = _gather_context(v_cache, chunk.block_table, 1, nkv, hd)[0, :, :ctx]
            qpos = torch.arange(chunk.first_pos, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]   # [n, ctx]
            oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=True)
        out[s:e] = oc.transpose(0, 1)
    return out.view(T, nh * hd)
