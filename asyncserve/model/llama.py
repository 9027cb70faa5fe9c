"""Llama-family decoder as plain functions over a flat batch of tokens (gpt-fast style).

One forward for every family (model/config.py's Family: Qwen2's q/k/v biases, Qwen3's and Gemma 3's
q/k norms (OLMo 2's over all heads), Gemma's (1 + w) norms around attention and MLP (OLMo 2's only
after them), GeGLU, scaled embeddings, soft-capping and sliding windows, Phi-3 as Llama once its fused
projections are split (Phi-4-mini's RoPE on part of each head), SmolLM3's layers without RoPE,
Granite's multipliers, Mixtral's and Qwen-MoE's mixtures of experts), each feature a small branch on
data the weights or the config carry.

A step's tokens from many sequences are concatenated: decode tokens first (one per sequence), then
prefill chunks. Base projections run once for all tokens; when a step has LoRA tokens, the
batched-LoRA backend runs each projection group (base and LoRA, which it may fuse). KV lives in
the unified pool's pages (pager/pool.py). On CPU with the native kernels, where the step's LoRA is
lora_segments' (LoraHook.native_step), the same layer loop runs in one native call
(kernels/cpu/decoder.h), for every dense family and every projection (dense or GGUF blocks): the same
kernels in the same order, the same logits. Mixtures of experts run the Python loop: each expert's
tokens are known only once the router has run, mid-layer.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

import kernels.cpu as cpu_kernels
from asyncserve.model import hugepages
from asyncserve.model.config import GROUPS, ROPE_TYPES, ModelConfig, MoeConfig
from asyncserve.model.linear_attention import LinearAttnWeights, LinearStep, gated_delta_net
from asyncserve.model.linear import (Linear, QuantEmbedding, QuantizedWeight, QuantLinear, make_embedding,
                                     make_linear, make_weight_linear)

log = logging.getLogger(__name__)


class LoraHook(Protocol):
    """What forward() asks of a batched-LoRA backend (asyncserve/lora/): whether the step has LoRA
    tokens, and each projection group's output, base and LoRA together; or the whole step's LoRA
    for the native layer loop."""
    @property
    def active(self) -> bool: ...

    def project(self, layer: int, group: str, x: torch.Tensor, base: Linear) -> torch.Tensor:
        """x: [T, in] -> [T, out] of ``base`` plus the step's adapters' LoRA for their tokens."""

    def native_step(self) -> NativeStepLora | None:
        """The step's LoRA as kernels.cpu.lora_segments computes it in every group, or None where
        some group needs ``project``."""

    def experts(self) -> ExpertLora | None:
        """The step's LoRA on the routed experts, None where no step adapter has any."""


class VocabHook(Protocol):
    """A step's LoRA on the token embeddings and the LM head, or those saved whole (lora/vocab.py's VocabStep)."""

    def embed_(self, h: torch.Tensor, ids: torch.Tensor) -> None: ...

    def head_(self, logits: torch.Tensor, hs: torch.Tensor) -> None: ...

    def native_head(self) -> tuple: ...      # head_ as the native layer loop takes it (decoder.h's head_runs ...)


@dataclass
class NativeStepLora:
    """A step's LoRA for the native layer loop (kernels/cpu/decoder.h): per group in GROUPS order, its
    runs [num_runs, 3] (None: no step adapter targets it) and projections [P_g, 3], with the pool and
    adapter tables (LoraBatch.tables() or the backend's SlotTables: a run's adapter indexes them), as
    lora_segments takes them."""
    runs: list[torch.Tensor | None]
    projections: list[torch.Tensor]
    flat: torch.Tensor
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    # DoRA adapters' rows (lora/dora.py): runs [n, 3] (first row, end row, index into dora_scales), the
    # scales [L, all groups' outputs] float32, and group g's columns dora_columns[g]..dora_columns[g + 1]
    dora_runs: torch.Tensor | None = None
    dora_scales: list[torch.Tensor] = field(default_factory=list)
    dora_columns: list[int] = field(default_factory=list)


@dataclass
class ExpertLora:
    """A step's LoRA on a mixture's routed experts and gates: each token's adapter as a row of the tables
    (-1: none), and as runs of tokens, and the pool and tables as lora_segments takes them, whose columns
    ModelConfig.expert_column(e) + 0, 1, 2 are expert e's gate, up and down projections, and
    expert_column(experts) + 0, 1 the router and the shared expert's gate (ModelConfig.lora_projections)."""
    flat: torch.Tensor
    token_rows: torch.Tensor         # [T] int32
    runs: torch.Tensor               # [num_runs, 3] int64 CPU: first token, end token, row of the tables
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]   # ranks, a_ptr, b_ptr, scaling


# Projections are Linear objects over the checkpoint's [out, in] weights (model/linear.py picks
# the fastest kernel and memory layout for the device).
@dataclass
class ExpertWeights:
    """A layer's mixture of experts (ModelConfig.moe)."""
    router: Linear                  # hidden -> experts
    gate_up: list[Linear]           # per expert: hidden -> 2 expert_size
    down: list[Linear]              # per expert: expert_size -> hidden
    shared_gate: Linear | None      # hidden -> 1: the sigmoid gate of the shared expert (LayerWeights.gate_up/down)
    # the experts in one native call (kernels.cpu.native_experts), built on first use
    _native: object = field(default=None, repr=False, compare=False)

    def linears(self) -> list[Linear]:
        return [self.router, *self.gate_up, *self.down] + [self.shared_gate] * (self.shared_gate is not None)

    def native(self):
        if self._native is None:
            self._native = cpu_kernels.native_experts(*_native_projections([*self.gate_up, *self.down]))
        return self._native


def _native_projections(linears: list[Linear]) -> tuple[list, list, list]:
    """The projections as the native kernels take them: each Linear's one weight (packed, oneDNN's or
    dense) and no types, or a QuantLinear's GGUF parts and their ggml types; and their out_features."""
    return ([[b for b, _ in p.weight.parts] if isinstance(p, QuantLinear) else [p.weight] for p in linears],
            [[t for _, t in p.weight.parts] if isinstance(p, QuantLinear) else [] for p in linears],
            [p.out_features for p in linears])


@dataclass
class LayerWeights:
    input_norm: torch.Tensor | None   # [hidden]; None: no norm before attention (OLMo 2)
    qkv: Linear | None         # hidden -> q + 2 kv (gated attention: q_proj's queries and gates, then k, v);
    o: Linear | None           # q -> hidden;  both None in a linear-attention layer (Qwen3.5)
    post_norm: torch.Tensor | None    # [hidden], before the MLP; None: none (OLMo 2)
    gate_up: Linear | None     # hidden -> 2 inter: the dense MLP (a mixture's shared expert; None: it has none)
    down: Linear | None        # inter -> hidden
    # as the family has them (norm weights: (1 + w) in float32 for Gemma's, see build_weights)
    qkv_bias: torch.Tensor | None = None       # [q + 2 kv]
    q_norm: torch.Tensor | None = None         # [head_dim], or [q] normed whole (OLMo 2)
    k_norm: torch.Tensor | None = None         # [head_dim], or [kv]
    attn_out_norm: torch.Tensor | None = None  # [hidden] Gemma's post_attention_layernorm
    mlp_out_norm: torch.Tensor | None = None   # [hidden] Gemma's post_feedforward_layernorm
    experts: ExpertWeights | None = None       # a mixture of experts in place of (or beside) the dense MLP
    linear: LinearAttnWeights | None = None    # Qwen3.5's Gated DeltaNet in place of attention


@dataclass
class LlamaWeights:
    embed: torch.Tensor | QuantEmbedding   # [vocab, hidden]; GGUF blocks kept: rows dequantized at lookup
    layers: list[LayerWeights]
    norm: torch.Tensor         # [hidden]
    lm_head: Linear | None     # hidden -> vocab (over the embedding itself when tied, unless reordered);
                               # None on a tensor-parallel rank that computes no logits (model/shard.py)
    embed_scale: float | None = None   # Gemma: sqrt(hidden) as the weights' dtype rounds it; Granite's multiplier
    # the native layer loop over these weights (kernels.cpu.native_decoder), built on first use
    _decoder: object = field(default=None, repr=False, compare=False)

    def set_projection(self, layer: int, group: str, linear: Linear) -> None:
        """Swap one layer's projection group (e.g. for a merged adapter's weights)."""
        setattr(self.layers[layer], group, linear)
        self._decoder = None

    def linears(self) -> list[Linear | None]:
        """Every projection group, qkv, o, gate_up, down per layer (GROUPS order; None where a mixture of
        experts has no dense MLP), then the lm_head."""
        return [getattr(lw, g) for lw in self.layers for g in GROUPS] + [self.lm_head] * (self.lm_head is not None)

    def native_decoder(self, config: ModelConfig):
        """The native layer loop over these weights: each projection as its Linear holds it, a QuantLinear
        as its GGUF parts, which the loop applies with QuantLinear's op."""
        if self._decoder is None:
            self._decoder = cpu_kernels.native_decoder(
                [t for lw in self.layers for t in (lw.input_norm, lw.post_norm, lw.qkv_bias, lw.q_norm, lw.k_norm,
                                                   lw.attn_out_norm, lw.mlp_out_norm)],
                *_native_projections(self.linears()),
                [config.window(i) or 0 for i in range(config.num_layers)],
                [config.local_rope(i) for i in range(config.num_layers)], self.norm, config.num_heads,
                config.num_kv_heads, config.head_dim, config.rms_norm_eps, config.scale, config.attn_softcap,
                config.family.activation == "gelu_tanh", config.residual_multiplier)
        return self._decoder

    def nbytes(self) -> int:
        tensors = [self.norm] + [t for lw in self.layers for t in (
            lw.input_norm, lw.post_norm, lw.qkv_bias, lw.q_norm, lw.k_norm, lw.attn_out_norm, lw.mlp_out_norm)
            if t is not None]
        tensors += [t for lw in self.layers if lw.linear is not None
                    for t in (lw.linear.conv, lw.linear.dt_bias, lw.linear.decay_rate, lw.linear.norm)]
        linear_attention = [p for lw in self.layers if lw.linear is not None
                            for p in (lw.linear.in_proj, lw.linear.out_proj)]
        quantized = isinstance(self.embed, QuantEmbedding)
        embed = self.embed.nbytes if quantized else self.embed.numel() * self.embed.element_size()
        shared = self.lm_head is not None and self.lm_head.weight is (self.embed.weight if quantized else self.embed)
        experts = [p for lw in self.layers if lw.experts is not None for p in lw.experts.linears()]
        return (embed + sum(t.numel() * t.element_size() for t in tensors)
                + sum(p.nbytes for p in self.linears() + experts + linear_attention if p is not None)
                - (self.lm_head.nbytes if shared else 0))


def build_weights(config: ModelConfig, weights: dict[str, torch.Tensor | QuantizedWeight], dtype: torch.dtype,
                  device: torch.device, head: bool = True) -> LlamaWeights:
    """Fuse q/k/v and gate/up, cast and move; consumes ``weights`` to keep peak memory low. Projections
    given as GGUF blocks (QuantizedWeight) stay blocks where the CPU's quantized kernels run. config and
    weights may be a tensor-parallel rank's shard (model/shard.py); head False: no lm_head (a rank that
    computes no logits)."""
    def take(name: str) -> torch.Tensor | QuantizedWeight:
        try:
            return weights.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint is missing tensor {name!r}") from None

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    def linear(*names: str) -> Linear:
        parts = [take(name) for name in names]
        if all(isinstance(t, QuantizedWeight) for t in parts):
            return make_weight_linear(QuantizedWeight.cat(parts), dtype, device)
        dense = [t.dequantize() if isinstance(t, QuantizedWeight) else t for t in parts]
        return make_linear(put(torch.cat(dense) if len(dense) > 1 else dense[0]))

    family = config.family

    def norm(name: str) -> torch.Tensor:
        # Gemma's RMSNorm multiplies by (1 + w) in float32 and rounds once after (as transformers does);
        # _rms_norm sees the float32 weight and computes in float32
        if family.unit_offset_norms:
            return (take(name).float() + 1.0).to(device).contiguous()
        return put(take(name))

    def experts(p: str, moe: MoeConfig | None) -> ExpertWeights | None:
        if moe is None:
            return None
        return ExpertWeights(
            router=linear(p + "mlp.gate.weight"),
            gate_up=[linear(f"{p}mlp.experts.{e}.gate_proj.weight", f"{p}mlp.experts.{e}.up_proj.weight")
                     for e in range(moe.num_experts)],
            down=[linear(f"{p}mlp.experts.{e}.down_proj.weight") for e in range(moe.num_experts)],
            shared_gate=linear(p + "mlp.shared_expert_gate.weight") if moe.shared_size else None)

    def linear_attention(p: str) -> LinearAttnWeights:
        p += "linear_attn."
        return LinearAttnWeights(
            in_proj=linear(*(p + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a"))),
            conv=put(take(p + "conv1d.weight")[:, 0]), dt_bias=take(p + "dt_bias").float().to(device),
            decay_rate=-take(p + "A_log").float().exp().to(device), norm=put(take(p + "norm.weight")),
            out_proj=linear(p + "out_proj.weight"))

    layers = []
    mlp = config.mlp_module() + "."
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        sandwich, pre = family.sandwich_norms, family.pre_norms
        attends = not config.is_linear(i)
        qk_norm = (family.qk_norm or family.whole_qk_norm) and attends
        layers.append(LayerWeights(
            input_norm=norm(p + "input_layernorm.weight") if pre else None,
            qkv=linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")) if attends else None,
            o=linear(p + "self_attn.o_proj.weight") if attends else None,
            # the MLP's input norm (Gemma names the attention output's norm post_attention_layernorm)
            post_norm=norm(p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"))
            if pre else None,
            gate_up=linear(p + mlp + "gate_proj.weight", p + mlp + "up_proj.weight") if config.dense_mlp else None,
            down=linear(p + mlp + "down_proj.weight") if config.dense_mlp else None,
            qkv_bias=put(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            if family.qkv_bias and attends else None,
            q_norm=norm(p + "self_attn.q_norm.weight") if qk_norm else None,
            k_norm=norm(p + "self_attn.k_norm.weight") if qk_norm else None,
            attn_out_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
            mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
            experts=experts(p, config.moe),
            linear=None if attends else linear_attention(p),
        ))
    embed = make_embedding(take("model.embed_tokens.weight"), dtype, device)
    if not head:
        weights.pop("lm_head.weight", None)
        lm_head = None
    elif config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
        # one copy of a table kept in blocks: the head is a QuantLinear over them
        lm_head = make_weight_linear(embed.weight, dtype, device, panels=False) if isinstance(embed, QuantEmbedding) \
            else make_linear(embed)
    else:
        lm_head = linear("lm_head.weight")
    _check_shapes(config, embed, next(lw for lw in layers if lw.qkv is not None), lm_head)
    embed_scale = float(torch.tensor(config.hidden_size ** 0.5, dtype=dtype)) if family.scaled_embeddings \
        else config.embedding_multiplier
    if device.type == "cpu":
        hugepages.return_freed_memory()
    return LlamaWeights(embed=embed, layers=layers, norm=norm("model.norm.weight"), lm_head=lm_head,
                        embed_scale=embed_scale)


def _check_shapes(config: ModelConfig, embed: torch.Tensor | QuantEmbedding, layer: LayerWeights,
                  lm_head: Linear | None) -> None:
    h = config.hidden_size
    expected = {
        "embed_tokens": (tuple(embed.shape), (config.vocab_size, h)),
        "q/k/v_proj": (layer.qkv.shape, (config.q_proj_size + 2 * config.kv_size, h)),
        "o_proj": (layer.o.shape, (h, config.q_size)),
    }
    if layer.gate_up is not None:
        expected["gate/up_proj"] = (layer.gate_up.shape, (2 * config.intermediate_size, h))
        expected["down_proj"] = (layer.down.shape, (h, config.intermediate_size))
    if layer.experts is not None:
        size = config.moe.expert_size
        expected["the router"] = (layer.experts.router.shape, (config.moe.num_experts, h))
        expected["an expert's gate/up_proj"] = (layer.experts.gate_up[0].shape, (2 * size, h))
        expected["an expert's down_proj"] = (layer.experts.down[0].shape, (h, size))
    if lm_head is not None:
        expected["lm_head"] = (lm_head.shape, (config.vocab_size, h))
    for name, (shape, want) in expected.items():
        if shape != want:
            raise ValueError(f"{name} has shape {shape}, the config implies {want}")


# ---- rotary embeddings ---------------------------------------------------------------------------

def rope_inv_freq(config: ModelConfig, theta: float | None = None, long: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling factor for the config's RoPE; theta:
    another base, with plain RoPE (Gemma 3's sliding layers); long: longrope's long-context factors."""
    dim = config.rope_dim
    if theta is not None:
        return (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))).float(), 1.0
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    attn_factor = 1.0
    if kind == "default":
        pass
    elif kind == "longrope":
        # Phi-3: per-frequency factors, short below the pretraining context and long beyond it, and
        # one attention factor for both (transformers' _compute_longrope_parameters)
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq = 1.0 / (factors * config.rope_theta ** exponents)
        factor, original = scaling.get("factor", 1.0), scaling["original_max_position_embeddings"]
        attn_factor = scaling.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
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
    elif kind == "yarn":
        inv_freq, attn_factor = _yarn(inv_freq, scaling, dim, config.rope_theta)
    elif kind == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float64)
    else:
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, {', '.join(ROPE_TYPES)})")
    return inv_freq.float(), attn_factor


def _yarn(inv_freq: torch.Tensor, scaling: dict, dim: int, theta: float) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' _compute_yarn_parameters, llama.cpp's rope_yarn): the fast frequencies kept,
    the slow ones divided by the factor, a linear ramp between the dimensions that turn beta_fast and
    beta_slow times in the original context; cos/sin scaled by 0.1 ln(factor) + 1."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = scaling.get("attention_factor")
    if attn_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def turning_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turning_dim(scaling.get("beta_fast") or 32), turning_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), attn_factor


class Rope:
    """cos/sin tables up to max_position, indexed per step by token positions; local_cos/local_sin
    those of the layers ModelConfig.local_rope names (Gemma 3's sliding layers: their own base;
    SmolLM3's NoPE layers: identity; the same tensors otherwise)."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype):
        scaling = config.rope_scaling or {}
        # longrope (Phi-3): one set of factors at every position, as vLLM does: the long ones where
        # sequences may outgrow the pretraining context (long_factors, set by the engine from its
        # max_model_len; the model's whole context if unset), else the short ones. transformers picks
        # by a sequence's length and recomputes its KV when it grows past that context; cached K
        # here keeps its rotation, so a sequence rotates one way from its first token to its last.
        long = scaling.get("rope_type") == "longrope" and scaling.get(
            "long_factors", config.max_position > scaling["original_max_position_embeddings"])
        inv_freq, self.attn_factor = rope_inv_freq(config, long=long)
        pos = torch.arange(config.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)                      # [max_pos, hd/2]
        self.cos, self.sin = self._tables(freqs, self.attn_factor, device, dtype)
        self.local_cos, self.local_sin = self.cos, self.sin
        if config.nope_layers:             # identity tables (cos 1, sin 0), one row repeated: no rotation
            ones = torch.ones(1, config.rope_dim, device=device, dtype=dtype)
            self.local_cos, self.local_sin = ones.expand(config.max_position, -1), (0 * ones).expand(config.max_position, -1)
        elif config.rope_local_theta is not None:
            local = torch.outer(pos, rope_inv_freq(config, theta=config.rope_local_theta)[0])
            self.local_cos, self.local_sin = self._tables(local, 1.0, device, dtype)

    @staticmethod
    def _tables(freqs: torch.Tensor, factor: float, device: torch.device, dtype: torch.dtype):
        emb = torch.cat([freqs, freqs], dim=-1)                 # [max_pos, hd]
        return (emb.cos() * factor).to(device=device, dtype=dtype), (emb.sin() * factor).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [tokens] -> cos, sin: [tokens, 1, rope_dim]
        cos, sin = (self.local_cos, self.local_sin) if local else (self.cos, self.sin)
        return cos[positions][:, None, :], sin[positions][:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [tokens, heads, hd]; cos, sin: [tokens, 1, rope_dim] (HF rotate-half convention over the first
    # rope_dim dimensions, Q/K weights un-permuted; the rest pass unrotated)
    rope_dim = cos.shape[-1]
    if rope_dim < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], dim=-1)
    half = rope_dim // 2
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
    decode_padding: torch.Tensor   # [m] int64: the rows of the decodes' gathered context (num_decode *
                                   # max_pages * block) past their sequence's context, i.e. where decode_mask is False
    prefills: list[PrefillChunk]
    sample_index: torch.Tensor     # [n] int64: tokens whose next-token logits are needed (sampled, then scored)
    decode_tables: torch.Tensor | None = None   # [num_decode, >= max pages] int64: the decodes' block tables for
                                                # kernels.paged_attention (CUDA, CUDA graphs), which reads only
                                                # each context's rows; None: the gather paths above
    vocab: VocabHook | None = None  # LoRA on the embeddings and the head
    linear: LinearStep | None = None   # Qwen3.5's linear-attention layers: each sequence's run and state


def decode_masks(ctx: torch.Tensor, max_pages: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decodes' attention mask [n, max_pages * block] bool (True: within the context) and its padding
    rows (StepInputs.decode_padding), from their context lengths ctx [n] int64."""
    if not len(ctx):
        return torch.zeros(0, block, dtype=torch.bool), torch.zeros(0, dtype=torch.int64)
    mask = torch.arange(max_pages * block)[None, :] < ctx[:, None]
    return mask, (~mask).view(-1).nonzero().squeeze(1)


# ---- forward -------------------------------------------------------------------------------------

def forward(w: LlamaWeights, config: ModelConfig, rope: Rope, kv: torch.Tensor, inp: StepInputs,
            lora: LoraHook, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
    """Run all layers for the step's tokens; returns logits [n_sample, vocab] in the weights' dtype
    (the sampler upcasts them), None on a tensor-parallel rank without lm_head.

    kv: the pool's KV view [pages, 2, layers, block, kv_size]. reduce: tensor parallelism's all-reduce
    (in place, over the ranks) of the row-parallel o and down outputs, which are partial sums on a shard.
    """
    use_lora = lora.active
    # fused C++ norms, activations, RoPE + KV write and paged attention
    native = cpu_kernels.enabled_for(w.embed)
    # one attention plan per distinct window (None: global layers)
    step_attention = {window: plan_attention(inp, config.num_heads, config.num_kv_heads, config.head_dim,
                                             w.embed.dtype, native, scale=config.scale, softcap=config.attn_softcap,
                                             window=window)
                      for window in dict.fromkeys(config.layer_windows or [None])}
    h = w.embed(inp.input_ids) if isinstance(w.embed, QuantEmbedding) else F.embedding(inp.input_ids, w.embed)
    if inp.vocab is not None:
        inp.vocab.embed_(h, inp.input_ids)
    if w.embed_scale is not None:
        h = h * w.embed_scale
    # a step on fixed buffers (StepInputs.decode_tables: the CUDA graphs' decodes) plans no native attention
    plan = next(iter(step_attention.values()))
    decoder = (plan.native and config.moe is None and not config.linear_layers and cpu_kernels.decoder_loop_enabled()
               and _loop_without(reduce) and w.native_decoder(config))
    step_lora = lora.native_step() if decoder and use_lora else None
    if decoder and (step_lora is not None or not use_lora):
        logits = _forward_native(decoder, h, rope, kv, inp, plan, step_lora)
    else:
        logits = _forward_layers(w, config, rope, kv, inp, lora, h, step_attention, native, reduce)
    if config.final_softcap and logits is not None:      # Gemma 2: tanh(logits / cap) * cap
        logits = torch.tanh(logits / config.final_softcap) * config.final_softcap
    if config.logits_scaling != 1.0 and logits is not None:     # Granite
        logits = logits / config.logits_scaling
    return logits


def _loop_without(reduce) -> bool:
    """Whether the one-call native layer loop can run: not under tensor parallelism, whose all-reduces
    come between its kernels (said once per process)."""
    global _said_reduce
    if reduce is not None and not _said_reduce:
        log.info("tensor parallelism: the layers run in the Python loop over the native kernels, as the "
                 "native layer loop cannot all-reduce mid-layer")
        _said_reduce = True
    return reduce is None


_said_reduce = False


def _forward_layers(w: LlamaWeights, config: ModelConfig, rope: Rope, kv: torch.Tensor, inp: StepInputs,
                    lora: LoraHook, h: torch.Tensor, step_attention: dict[int | None, StepAttention],
                    native: bool, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
    """forward()'s layer loop in Python from the embedded tokens h [T, hidden]: the native kernels
    between the projections, or eager torch ops."""
    T = inp.input_ids.shape[0]
    nh, nkv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    q_size, kv_size = config.q_size, config.kv_size
    eps = config.rms_norm_eps
    # kv_rows: [pages * 2 * layers * block, kv_size]; K of layer l at write_rows + l*block, V at + layers*block
    num_layers, block = kv.shape[2], kv.shape[3]
    kv_rows = kv.view(-1, kv_size)
    use_lora = lora.active
    expert_lora = lora.experts() if use_lora and config.moe is not None else None
    gelu = config.family.activation == "gelu_tanh"
    if not native:
        tables = {False: rope.tables(inp.positions)}
        if rope.local_cos is not rope.cos:
            tables[True] = rope.tables(inp.positions, local=True)
        # KV rows this step writes, per layer: K rows then V rows, [layers, 2T]
        layer_rows = inp.write_rows + block * torch.arange(num_layers, device=inp.write_rows.device)[:, None]
        layer_rows = torch.cat([layer_rows, layer_rows + num_layers * block], dim=1)
    h, x = _residual_norm(h, None, w.layers[0].input_norm, eps, native)
    # the layers' KV in the pages (past the linear-attention ones), and the linear-attention layers' states
    state_index = config.state_indices()
    for li, lw in enumerate(w.layers):
        if lw.linear is not None:
            o = gated_delta_net(lw.linear, config.linear_attention, li, state_index[li], x, inp.linear, eps)
            h, x = _residual_norm(h, o, lw.post_norm, eps, native)
            h, x = _mlp_and_next_norm(w, config, li, lw, h, x, lora, use_lora, gelu, native, expert_lora, reduce)
            continue
        kl = state_index[li]
        window = config.window(li)
        local = config.local_rope(li)
        qkv = lora.project(li, "qkv", x, lw.qkv) if use_lora else lw.qkv(x)       # [T, q + 2kv]
        gate = None
        if config.family.gated_attention:   # Qwen3.5: each head's query, then its gate
            q_gate = qkv[:, :2 * q_size].view(T, nh, 2, hd)
            gate = q_gate[:, :, 1].reshape(T, q_size)
            qkv = torch.cat([q_gate[:, :, 0].reshape(T, q_size), qkv[:, 2 * q_size:]], dim=1)
        if lw.qkv_bias is not None:
            qkv += lw.qkv_bias
        if lw.q_norm is not None and native:    # per head, before RoPE, in place
            cpu_kernels.head_rms_norm(qkv, lw.q_norm, lw.k_norm, nh, nkv, eps)
        elif lw.q_norm is not None:         # per head, or (OLMo 2) q and k whole
            qk = qkv[:, :q_size + kv_size]
            q_heads, k_heads = (nh, nkv) if lw.q_norm.numel() == hd else (1, 1)
            qk[:, :q_size] = _rms_norm(qk[:, :q_size].view(T, q_heads, -1), lw.q_norm, eps).view(T, q_size)
            qk[:, q_size:] = _rms_norm(qk[:, q_size:].view(T, k_heads, -1), lw.k_norm, eps).view(T, kv_size)
        if native:
            # in place in qkv; the layer's K rows start li blocks into a page, its V rows num_layers further
            cos_table, sin_table = (rope.local_cos, rope.local_sin) if local else (rope.cos, rope.sin)
            cpu_kernels.rope_write_kv(qkv, inp.positions, cos_table, sin_table, kv_rows, inp.write_rows,
                                      kl * block, (num_layers + kl) * block, nh, nkv)
            q = qkv[:, :q_size].view(T, nh, hd)
            k = qkv[:, q_size:q_size + kv_size].view(T, nkv, hd)
        else:
            cos, sin = tables[local and len(tables) > 1]
            qk = apply_rope(qkv[:, :q_size + kv_size].view(T, nh + nkv, hd), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]                          # [T, nh, hd], [T, nkv, hd]
        v = qkv[:, q_size + kv_size:]
        if not native:
            kv_rows.index_copy_(0, layer_rows[kl], torch.cat([k.reshape(T, kv_size), v]))
        attn = attention(q, k, v.view(T, nkv, hd), kv[:, 0, kl], kv[:, 1, kl], inp, step_attention[window])  # [T, q]
        if gate is not None:
            attn = attn * torch.sigmoid(gate)
        o = lora.project(li, "o", attn, lw.o) if use_lora else lw.o(attn)
        if reduce is not None:              # row-parallel: the ranks' partial sums (their LoRA's too)
            o = reduce(o)
        if lw.attn_out_norm is not None:    # Gemma: the attention's output normed before the residual add
            o = _norm(o, lw.attn_out_norm, eps, native)
        if config.residual_multiplier != 1.0:      # Granite
            o = o * config.residual_multiplier
        h, x = _residual_norm(h, o, lw.post_norm, eps, native)
        h, x = _mlp_and_next_norm(w, config, li, lw, h, x, lora, use_lora, gelu, native, expert_lora, reduce)
    if w.lm_head is None:
        return None
    _, hs = _residual_norm(h[inp.sample_index], None, w.norm, eps, native)
    logits = w.lm_head(hs)
    if inp.vocab is not None:
        inp.vocab.head_(logits, hs)
    return logits


def _mlp_and_next_norm(w: LlamaWeights, config: ModelConfig, li: int, lw: LayerWeights, h: torch.Tensor,
                       x: torch.Tensor, lora: LoraHook, use_lora: bool, gelu: bool, native: bool, expert_lora,
                       reduce) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's MLP on its normed input x, added to the residual h; (h, the next layer's normed input)."""
    eps = config.rms_norm_eps
    d = _dense_mlp(li, lw, x, lora, use_lora, gelu, native) if lw.gate_up is not None else None
    if lw.experts is not None:
        d = moe_mlp(x, lw.experts, config.moe, native, d, expert_lora, li)
    if reduce is not None:
        d = reduce(d)
    if lw.mlp_out_norm is not None:
        d = _norm(d, lw.mlp_out_norm, eps, native)
    if config.residual_multiplier != 1.0:
        d = d * config.residual_multiplier
    if li + 1 < len(w.layers):
        return _residual_norm(h, d, w.layers[li + 1].input_norm, eps, native)
    return h + d, None


def _forward_native(decoder, h: torch.Tensor, rope: Rope, kv: torch.Tensor, inp: StepInputs, a: StepAttention,
                    step_lora: NativeStepLora | None) -> torch.Tensor:
    """_forward_layers in one native call (kernels/cpu/decoder.h): the same kernels, the same logits."""
    n = inp.num_decode
    if step_lora is None:
        lora = (None, [], [], None, None, None, None, None, [], [])
    else:
        lora = (step_lora.flat, step_lora.runs, step_lora.projections, *step_lora.tables, step_lora.dora_runs,
                step_lora.dora_scales, step_lora.dora_columns)
    decode_tables = a.decode_pages.view(n, -1) if n else a.decode_pages.view(0, 0)
    head = inp.vocab.native_head() if inp.vocab is not None else (None, [], [], [])
    return decoder.forward(h, inp.positions, rope.cos, rope.sin, rope.local_cos, rope.local_sin, kv, inp.write_rows,
                           n, decode_tables, a.decode_lens, a.prefill_tables, a.prefill_starts, a.prefill_first_pos,
                           inp.sample_index, *lora, *head)


def _dense_mlp(li: int, lw: LayerWeights, x: torch.Tensor, lora: LoraHook, use_lora: bool, gelu: bool,
               native: bool) -> torch.Tensor:
    """The layer's dense MLP (a mixture's shared expert) with the step's LoRA: x [T, hidden] -> [T, hidden]."""
    gu = lora.project(li, "gate_up", x, lw.gate_up) if use_lora else lw.gate_up(x)   # [T, 2 inter]
    act = gelu_tanh_mul(gu, native) if gelu else silu_mul(gu, native)                 # [T, inter]
    return lora.project(li, "down", act, lw.down) if use_lora else lw.down(act)


def moe_mlp(x: torch.Tensor, experts: ExpertWeights, moe: MoeConfig, native: bool,
            shared: torch.Tensor | None = None, lora: ExpertLora | None = None, layer: int = 0) -> torch.Tensor:
    """x [T, hidden] -> the experts' outputs [T, hidden], each token's top_k summed by their router
    probabilities in float32, experts in order (as transformers adds them); plus shared (the shared
    expert's output) times sigmoid(x . shared_gate). native: the experts in one native call. lora: the
    step's LoRA on the experts, whose tables' ``layer`` this is."""
    k = moe.top_k
    logits = experts.router(x)                                            # [T, experts]
    gates = ModelConfig.expert_column(moe.num_experts)                    # the router's column in the tables
    if lora is not None:
        _gate_lora_(logits, x, lora, layer, gates, native)
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_e = torch.topk(probs, k, dim=-1)                           # [T, k]
    if moe.normalize:
        top_p /= top_p.sum(dim=-1, keepdim=True)
    if native and lora is not None:
        out = experts.native().forward_lora(x.contiguous(), top_e, top_p.contiguous(), lora.flat, lora.token_rows,
                                            *lora.tables, layer, ModelConfig.expert_column(0))
    elif native:
        out = experts.native().forward(x.contiguous(), top_e, top_p.contiguous())
    else:
        out = _experts_eager(x, experts, moe, top_e, top_p, lora, layer)
    if shared is not None:
        gate = experts.shared_gate(x)                                     # [T, 1]
        if lora is not None:
            _gate_lora_(gate, x, lora, layer, gates + 1, native)
        out += torch.sigmoid(gate) * shared
    return out


def _gate_lora_(y: torch.Tensor, x: torch.Tensor, lora: ExpertLora, layer: int, column: int, native: bool) -> None:
    """y [T, out] (a gate's logits) += each token's adapter's LoRA of that gate (the tables' column) on x."""
    if native:
        cpu_kernels.lora_segments(y, x, lora.flat, lora.runs, *lora.tables, layer,
                                  torch.tensor([[column, 0, y.shape[1]]]))
    else:
        _expert_lora_(y, x, lora, layer, torch.arange(x.shape[0], device=x.device), [(column, 0, y.shape[1])])


def _experts_eager(x: torch.Tensor, experts: ExpertWeights, moe: MoeConfig, top_e: torch.Tensor,
                   top_p: torch.Tensor, lora: ExpertLora | None = None, layer: int = 0) -> torch.Tensor:
    """moe_mlp's experts in torch ops: the (token, choice) pairs grouped by expert, tokens in order
    within each (one host read of the counts), each expert's tokens as one batch."""
    k = moe.top_k
    order = top_e.view(-1).argsort(stable=True)
    counts = torch.bincount(top_e.view(-1), minlength=moe.num_experts).tolist()
    tokens, weights = order // k, top_p.view(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = tokens[start:start + n]
            xe = x[rows]                                                    # [n, hidden]
            gate_up = experts.gate_up[e](xe)                                # [n, 2 expert_size]
            inter = gate_up.shape[1] // 2
            column = ModelConfig.expert_column(e)
            if lora is not None:
                _expert_lora_(gate_up, xe, lora, layer, rows, [(column, 0, inter), (column + 1, inter, inter)])
            act = silu_mul(gate_up)
            y = experts.down[e](act)                                        # [n, hidden]
            if lora is not None:
                _expert_lora_(y, act, lora, layer, rows, [(column + 2, 0, y.shape[1])])
            out.index_add_(0, rows, (y.float() * weights[start:start + n, None]).to(x.dtype))
            start += n
    return out


def _expert_lora_(y: torch.Tensor, x: torch.Tensor, lora: ExpertLora, layer: int, tokens: torch.Tensor,
                  columns: list[tuple[int, int, int]]) -> None:
    """y [n, out] += the LoRA of an expert's projections (or a gate's) on x [n, in], rows of ``tokens``
    each with its token's adapter: columns (tables column, first column of y, width). The torch-ops form
    of what experts.h's forward_lora and lora_segments do: in float32, y rounded once."""
    ranks, a_ptr, b_ptr, scaling = lora.tables
    token_rows = lora.token_rows[tokens]
    for row in token_rows.unique().tolist():
        if row < 0:
            continue
        picked = (token_rows == row).nonzero().squeeze(1)
        xs = x[picked].float()
        for column, first, width in columns:
            r = int(ranks[row, column])
            if r:
                a = pool_rows(lora.flat, a_ptr[row, layer, column, :r], x.shape[1]).float()    # [r, in]
                b = pool_rows(lora.flat, b_ptr[row, layer, column, :r], width).float()         # [r, out]
                delta = (xs @ a.t() * scaling[row, layer, column]) @ b                          # [picked, width]
                y[picked, first:first + width] = (y[picked, first:first + width].float() + delta).to(y.dtype)


def pool_rows(flat: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """flat[offsets[..., None] + arange(width)], i.e. the ``width`` elements at each offset (a pool row),
    gathered through a view of flat's overlapping windows rather than an index tensor of every element."""
    windows = flat.as_strided((flat.numel() - width + 1, width), (1, 1))
    return windows.index_select(0, offsets.reshape(-1)).view(*offsets.shape, width)


def silu_mul(gate_up: torch.Tensor, native: bool = False) -> torch.Tensor:
    """The MLP's activation: gate_up [T, 2 inter] (gate, then up) -> silu(gate) * up [T, inter]; native:
    the C++ kernel's one pass (the eager form's rounding steps)."""
    if native:
        return cpu_kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor, native: bool = False) -> torch.Tensor:
    """GeGLU (Gemma): gate_up [T, 2 inter] (gate, then up) -> gelu_tanh(gate) * up [T, inter]; native: the
    C++ kernel's one pass."""
    if native:
        return cpu_kernels.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension. A float32 weight over lower-precision x is Gemma's (1 + w),
    applied in float32 and rounded once, as transformers does."""
    if weight.dtype != x.dtype:
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, native: bool) -> torch.Tensor:
    """rms_norm(x) * weight as _rms_norm, new [T, hidden]; native: the C++ kernel (x left as it is)."""
    return cpu_kernels.add_rms_norm(x, None, weight, eps) if native else _rms_norm(x, weight, eps)


def _residual_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                   native: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta) * weight), delta None adding nothing; weight None (OLMo 2: no norm
    before attention or the MLP): a copy of h + delta. h: [T, hidden]. The native kernel does both in one
    pass and adds into h in place (it is this step's own activation)."""
    if weight is None:
        h = h + delta if delta is not None else h
        return h, h.clone()
    if native:
        return h, cpu_kernels.add_rms_norm(h, delta, weight, eps)
    if delta is not None:
        h = h + delta
    return h, _rms_norm(h, weight, eps)


def _gather_context(cache: torch.Tensor, a: StepAttention) -> torch.Tensor:
    """The decodes' context rows of one layer's cache [pool pages, block, kv_size], as [n * p * block,
    kv_size], with the rows past each context zeroed. Those hold whatever the page's earlier owner
    (another sequence, or an adapter's weights) left there, NaN included: masking their scores to
    -inf is not enough, as a probability of 0 times a NaN value is NaN."""
    rows = cache.index_select(0, a.decode_pages).view(-1, cache.shape[-1])
    return rows.index_fill_(0, a.decode_padding, 0)


def _bmm_attention(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether attention runs as the bmm's below rather than SDPA. On CPU, SDPA is far slower in bf16
    than in fp32 (one query row, 16 decodes, 128 context, SmolLM2's heads: 885 vs 154 us; a 64-token
    causal prefill: 160-213 us where the bmm's take 100; Zen5, 2 threads)."""
    return device.type == "cpu" and dtype == torch.bfloat16


@dataclass
class StepAttention:
    """What attention needs in every layer of a step, built once per step by plan_attention."""
    bmm: bool                           # _bmm_attention(): the bmm forms instead of SDPA
    native: bool                        # kernels.cpu's paged decode and prefill attention (no masks, no gathers)
    decode_pages: torch.Tensor          # [n * p] int64: the decodes' block tables padded to p pages
    decode_padding: torch.Tensor        # StepInputs.decode_padding
    decode_mask: torch.Tensor           # SDPA: [n, 1, 1, p * block] bool (True = attend); bmm: [n, 1, p * block]
                                        # additive bias (0 or -inf) in the queries' dtype
    q_blocks: torch.Tensor | None       # bmm: [n, nkv, group, nkv, hd], zero but for the diagonal blocks
    prefill_masks: list[torch.Tensor | None]   # per chunk: bmm: [group * n, ctx] additive bias;
                                               # SDPA: [n, ctx] bool, None for a causal chunk from position 0
    decode_lens: torch.Tensor | None = None    # native: [n] int64, each decode's context length
    prefill_tables: torch.Tensor | None = None     # native: [chunks, max_pages] int64, padded with page 0
    prefill_starts: torch.Tensor | None = None     # native: [chunks + 1] int64, the chunks' first rows, then the end
    prefill_first_pos: torch.Tensor | None = None  # native: [chunks] int64, each chunk's first position
    scale: float | None = None                 # the scores' scale; None: head_dim ** -0.5
    softcap: float | None = None               # scores -> tanh(scores / cap) * cap before the mask (native, bmm)
    window: int | None = None                  # native: the layers' sliding window (the masks have it otherwise)
    decode_tables: torch.Tensor | None = None      # StepInputs.decode_tables: the decodes run kernels.paged_attention


def plan_attention(inp: StepInputs, num_heads: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, native: bool = False, *, scale: float | None = None,
                   softcap: float | None = None, window: int | None = None) -> StepAttention:
    """The step's masks (and the bmm path's query blocks), once for all layers of one kind. window: a
    query sees only the last ``window`` positions, its own included (sliding layers); softcap: the
    native kernels and the bmm forms, which have the scores in hand (SDPA does not take a cap)."""
    device = inp.input_ids.device
    bmm = _bmm_attention(device, dtype) or softcap is not None
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    # kernels.paged_attention (CUDA, CUDA graphs) takes the scale but neither a window nor a cap
    paged = inp.decode_tables is not None and window is None and softcap is None
    if paged and not inp.prefills:          # no masks, no gathers, no host reads: capturable
        return StepAttention(bmm, False, inp.decode_pages, inp.decode_padding, inp.decode_mask, None, [],
                             inp.positions[:inp.num_decode] + 1, scale=scale, decode_tables=inp.decode_tables)
    if native:
        # a decode's context ends at its own token; prefill chunks follow the decodes, one after another
        return StepAttention(bmm, True, inp.decode_pages, inp.decode_padding, inp.decode_mask, None, [],
                             inp.positions[:inp.num_decode] + 1, *_prefill_tables(inp.prefills), scale=scale,
                             softcap=softcap, window=window)
    masks = []
    for chunk in inp.prefills:
        n = chunk.end - chunk.start
        ctx = chunk.first_pos + n
        if not bmm and chunk.first_pos == 0 and (window is None or window >= n):
            masks.append(None)
            continue
        qpos = torch.arange(chunk.first_pos, ctx, device=device)
        kpos = torch.arange(ctx, device=device)[None, :]
        attend = kpos <= qpos[:, None]                                              # [n, ctx]
        if window is not None:
            attend &= kpos > qpos[:, None] - window
        masks.append(_bias(attend, dtype).repeat(group, 1) if bmm else attend)
    mask, q_blocks = inp.decode_mask, None
    if window is not None and inp.num_decode:
        # a decode at position p sees p - window + 1 .. p; rows before stay finite (their owner's K/V)
        first = inp.positions[:inp.num_decode] + 1 - window
        mask = mask & (torch.arange(mask.shape[-1], device=device) >= first[:, None])[:, None, None, :]
    if bmm and inp.num_decode:
        n = inp.num_decode
        mask = _bias(mask, dtype).view(n, 1, -1)
        q_blocks = torch.zeros(n, num_kv_heads, group, num_kv_heads, head_dim, dtype=dtype, device=device)
    if paged:                               # the decodes of a mixed step: the same kernel
        return StepAttention(bmm, False, inp.decode_pages, inp.decode_padding, mask, q_blocks, masks,
                             inp.positions[:inp.num_decode] + 1, scale=scale, decode_tables=inp.decode_tables)
    return StepAttention(bmm, False, inp.decode_pages, inp.decode_padding, mask, q_blocks, masks,
                         scale=scale, softcap=softcap)


def _prefill_tables(chunks: list[PrefillChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunks' block tables padded with page 0 [chunks, max_pages], their rows [chunks + 1] and first
    positions [chunks], as kernels.cpu.paged_prefill_attention takes them."""
    width = max((len(c.block_table) for c in chunks), default=0)
    tables = torch.zeros(len(chunks), width, dtype=torch.int64)
    for i, c in enumerate(chunks):
        tables[i, :len(c.block_table)] = c.block_table
    starts = torch.tensor([c.start for c in chunks[:1]] + [c.end for c in chunks], dtype=torch.int64)
    return tables, starts, torch.tensor([c.first_pos for c in chunks], dtype=torch.int64)


def _bias(attend: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = attend) -> additive bias, 0 or -inf."""
    return torch.zeros(attend.shape, dtype=dtype, device=attend.device).masked_fill_(~attend, float("-inf"))


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, a: StepAttention) -> torch.Tensor:
    """q: [n, nh, hd]; k_cache, v_cache: [pool pages, block, kv_size] of one layer. Returns [n, nh, hd]."""
    n, nh, hd = q.shape
    kv_size = k_cache.shape[-1]
    nkv = kv_size // hd
    if a.native:      # reads only each decode's own context rows, never the padding
        out = torch.empty(n, nh, hd, dtype=q.dtype, device=q.device)
        cpu_kernels.paged_decode_attention(out, q, k_cache, v_cache, a.decode_pages.view(n, -1), a.decode_lens,
                                           a.scale, a.window, a.softcap)
        return out
    if a.decode_tables is not None:
        from kernels.paged_attention import paged_decode_attention
        out = torch.empty(n, nh, hd, dtype=q.dtype, device=q.device)
        paged_decode_attention(out, q, k_cache, v_cache, a.decode_tables, a.decode_lens, a.scale)
        return out
    k = _gather_context(k_cache, a).view(n, -1, kv_size)                         # [n, ctx, nkv * hd]
    v = _gather_context(v_cache, a).view(n, -1, kv_size)
    if not a.bmm:
        kc, vc = (t.view(n, -1, nkv, hd).transpose(1, 2) for t in (k, v))         # [n, nkv, ctx, hd]
        return F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, attn_mask=a.decode_mask,
                                              enable_gqa=True, scale=a.scale).squeeze(2)
    # Two bmm's over the gathered rows as they lie ([n, ctx, nkv * hd]) avoid the per-head copies of K
    # and V that grouped matmuls make (125 vs 184 us): head h's query sits in the columns of its KV
    # head h // group, zeros elsewhere, and its output is that block of the product (3x the
    # multiply-adds, a few M). Only the diagonal blocks of q_blocks are written, so the zeros stay.
    group = nh // nkv
    a.q_blocks.diagonal(dim1=1, dim2=3).copy_(q.view(n, nkv, group, hd).permute(0, 2, 3, 1))
    scores = _scores(a.decode_mask, a.q_blocks.view(n, nh, kv_size), k.transpose(1, 2), a)
    probs = torch.softmax(scores, dim=-1)                       # [n, nh, ctx]: bf16 in and out, fp32 inside
    out = torch.bmm(probs, v).view(n, nkv, group, nkv, hd)      # [n, query's KV head, group, KV head, hd]
    return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(n, nh, hd)


def _scores(mask: torch.Tensor, q: torch.Tensor, k_t: torch.Tensor, a: StepAttention) -> torch.Tensor:
    """mask + scale * q @ k_t, soft-capped before the mask where the plan says (Gemma 2)."""
    if a.softcap is None:
        return torch.baddbmm(mask, q, k_t, alpha=a.scale)
    scores = torch.bmm(q, k_t).mul_(a.scale / a.softcap).tanh_().mul_(a.softcap)
    return scores.add_(mask)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       a: StepAttention) -> torch.Tensor:
    """One sequence's chunk. q: [n, nh, hd]; k, v: [ctx, nkv, hd], the chunk's last; mask: as
    StepAttention.prefill_masks. Returns [n, nh, hd]."""
    n, nh, hd = q.shape
    nkv = k.shape[1]
    if not a.bmm:
        qc, kc, vc = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)   # heads first
        oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, is_causal=mask is None, enable_gqa=True,
                                            scale=a.scale)
        return oc.transpose(0, 1)
    # per KV head, its group's queries stacked as rows: no copies of K or V per query head
    group = nh // nkv
    qs = q.view(n, nkv, group, hd).permute(1, 2, 0, 3).reshape(nkv, group * n, hd)
    scores = _scores(mask, qs, k.permute(1, 2, 0), a)                            # [nkv, group * n, ctx]
    out = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1))           # [nkv, group * n, hd]
    return out.view(nkv, group, n, hd).permute(2, 0, 1, 3).reshape(n, nh, hd)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              inp: StepInputs, a: StepAttention) -> torch.Tensor:
    """q: [T, nh, hd]; k, v: [T, nkv, hd] of this step (already written to the cache);
    k_cache, v_cache: [pages, block, kv_size] of this layer. Returns [T, nh * hd]."""
    T, nh, hd = q.shape
    nkv = k.shape[1]
    nd = inp.num_decode
    if nd == T:
        return _decode_attention(q, k_cache, v_cache, a).view(T, nh * hd)
    out = torch.empty(T, nh, hd, dtype=q.dtype, device=q.device)
    if nd:
        # all decodes at once: gather their pages, padded to the longest context, mask the rest
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, a)
    if a.native:      # every chunk in one call, read through its block table (the chunks' own K/V included)
        cpu_kernels.paged_prefill_attention(out, q, k_cache, v_cache, a.prefill_tables, a.prefill_starts,
                                            a.prefill_first_pos, a.scale, a.window, a.softcap)
        return out.view(T, nh * hd)
    for chunk, mask in zip(inp.prefills, a.prefill_masks):
        s, e = chunk.start, chunk.end
        if chunk.first_pos == 0:
            kc, vc = k[s:e], v[s:e]          # the whole context is this chunk
        else:
            ctx = chunk.first_pos + (e - s)
            kc = k_cache.index_select(0, chunk.block_table).view(-1, nkv, hd)[:ctx]
            vc = v_cache.index_select(0, chunk.block_table).view(-1, nkv, hd)[:ctx]
        out[s:e] = _prefill_attention(q[s:e], kc, vc, mask, a)
    return out.view(T, nh * hd)
