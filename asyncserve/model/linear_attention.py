"""Qwen3.5's Gated DeltaNet layers (linear attention): the layer's math and each sequence's recurrent state.

Where a full-attention layer keeps every past token's K and V (the paged pool), a Gated DeltaNet layer keeps
per sequence a fixed-size state: the last conv_kernel - 1 inputs of its causal conv1d, and per value head a
matrix S [k_head_dim, v_head_dim]. Token t decays S by exp(g_t), writes v_t against what S already recalls
for k_t (the delta rule: S += k_t beta_t (v_t - S^T k_t)^T) and reads o_t = S^T q_t.

A step's tokens come in runs, one per sequence (StepInputs.linear): a decode is a run of one token, a
prompt chunk a longer run that starts from the state the sequence's previous chunk left (or from zeros at
its first token). Single-token runs update their states together; a longer run solves the rule 64 tokens
at a time in the closed form of _delta_rule, which is the token-by-token recurrence (up to rounding).

An adapter's LoRA on these layers' projections (in_proj_qkv, _z, _b, _a, out_proj) is kept beside the pool
(pager/adapters.py) and added per run of its rows, as the vocabulary's LoRA is (lora/vocab.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from asyncserve.model.config import LinearAttention
from asyncserve.model.linear import Linear

CHUNK = 64          # tokens of a prompt chunk solved at once (one triangular solve each)


@dataclass
class LinearAttnWeights:
    """One Gated DeltaNet layer (HF names under linear_attn.)."""
    in_proj: Linear            # hidden -> conv_dim + value_dim + 2 num_v_heads: in_proj_qkv, _z, _b, _a fused
    conv: torch.Tensor         # [conv_dim, conv_kernel] the depthwise causal conv1d's taps
    dt_bias: torch.Tensor      # [num_v_heads] float32
    decay_rate: torch.Tensor   # [num_v_heads] float32: -exp(A_log)
    norm: torch.Tensor         # [v_head_dim] the gated RMSNorm's weight (plain, not 1 + w)
    out_proj: Linear           # value_dim -> hidden


@dataclass
class StateRun:
    """One sequence's tokens in the step: [start, end), its state slot, and whether the state starts
    from zeros (the sequence's first token is in the run)."""
    start: int
    end: int
    slot: int
    fresh: bool


class LinearStates:
    """The recurrent states of the sequences that hold a slot (scheduler/block_manager.py hands them out):
    conv windows [layers, slots, conv_dim, kernel - 1] in the model's dtype and delta-rule states [layers,
    slots, v_heads, k_head_dim, v_head_dim] in float32, layers counting the linear-attention ones only
    (slots innermost: a layer's first slots are one block, which decodes update in place).
    Allocated for all slots at once: slots * nbytes_per_slot bytes."""

    def __init__(self, la: LinearAttention, num_layers: int, slots: int, dtype: torch.dtype, device: torch.device):
        self.conv = torch.zeros(num_layers, slots, la.conv_dim, la.conv_kernel - 1, dtype=dtype, device=device)
        self.state = torch.zeros(num_layers, slots, la.num_v_heads, la.k_head_dim, la.v_head_dim,
                                 dtype=torch.float32, device=device)

    @staticmethod
    def nbytes_per_slot(la: LinearAttention, num_layers: int, dtype: torch.dtype) -> int:
        conv = la.conv_dim * (la.conv_kernel - 1) * torch.empty(0, dtype=dtype).element_size()
        return num_layers * (conv + la.num_v_heads * la.k_head_dim * la.v_head_dim * 4)


class ModuleLora(Protocol):
    """An adapter's LoRA on one projection: y += (x·A^T)·B^T·scaling (pager/adapters.py's VocabRows)."""
    a: torch.Tensor          # [r, in]
    bt: torch.Tensor         # [r, out]
    scaling: float


class LoraRun(NamedTuple):
    """Rows [start, end) of one adapter, and its LoRA on the linear-attention layers: (layer, module) ->
    ModuleLora, module one of in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj."""
    start: int
    end: int
    rows: dict[tuple[int, str], ModuleLora]


@dataclass
class LinearStep:
    """What a step's linear-attention layers need: a run per sequence, in the step's token order, the states,
    and the runs of adapters with LoRA on these layers. Every layer reads the same: the single-token runs
    (updated together), their rows and slots, and the longer runs are sorted out once."""
    runs: list[StateRun]
    states: LinearStates
    lora: list[LoraRun] = field(default_factory=list)

    def __post_init__(self):
        self.singles = [r for r in self.runs if r.end - r.start == 1]
        self.longer = [r for r in self.runs if r.end - r.start > 1]
        device = self.states.state.device
        self.single_rows = torch.tensor([r.start for r in self.singles], dtype=torch.int64, device=device)
        self.single_slots = torch.tensor([r.slot for r in self.singles], dtype=torch.int64, device=device)


IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")     # in_proj's parts, in its column order


def gated_delta_net(w: LinearAttnWeights, la: LinearAttention, layer: int, index: int, x: torch.Tensor,
                    step: LinearStep, eps: float) -> torch.Tensor:
    """Model layer ``layer``'s output [T, hidden] for the step's tokens x [T, hidden] (normed); updates its
    states, the index-th of the linear-attention layers'."""
    proj = w.in_proj(x)                                            # [T, conv_dim + value_dim + 2 hv]
    widths = [la.conv_dim, la.value_dim, la.num_v_heads, la.num_v_heads]
    for part, start in zip(IN_PROJ, itertools.accumulate([0] + widths[:-1])):
        _add_lora(proj[:, start:], x, step.lora, (layer, part))
    conv_in, z, b, a = proj.split(widths, dim=1)
    beta = torch.sigmoid(b.float())                                # [T, hv]
    g = w.decay_rate * F.softplus(a.float() + w.dt_bias)           # [T, hv] log decays, <= 0
    mixed = torch.empty_like(conv_in)                              # [T, conv_dim] after conv and SiLU
    core = torch.empty(x.shape[0], la.num_v_heads, la.v_head_dim, dtype=torch.float32, device=x.device)
    states = step.states
    if step.singles:
        for r in step.singles:
            if r.fresh:
                states.conv[index, r.slot].zero_()
                states.state[index, r.slot].zero_()
        rows, slots = step.single_rows, step.single_slots
        window = states.conv[index, slots]                         # [n, conv_dim, kernel - 1]
        full = torch.cat([window, conv_in[rows, :, None]], dim=2)  # [n, conv_dim, kernel]
        states.conv[index, slots] = full[:, :, 1:]
        mixed[rows] = F.silu((full * w.conv).sum(dim=2))
        core[rows] = _decode_rule(states.state[index], slots, *_heads(mixed[rows], la), g[rows], beta[rows])
    for r in step.longer:
        window = states.conv[index, r.slot]                        # [conv_dim, kernel - 1]
        if r.fresh:
            window = torch.zeros_like(window)
        full = torch.cat([window, conv_in[r.start:r.end].t()], dim=1)       # [conv_dim, kernel - 1 + n]
        states.conv[index, r.slot] = full[:, full.shape[1] - (la.conv_kernel - 1):]
        conv = F.conv1d(full[None], w.conv[:, None, :], groups=la.conv_dim)[0]   # [conv_dim, n]
        mixed[r.start:r.end] = F.silu(conv.t())
        q, k, v = _heads(mixed[r.start:r.end], la)
        state = torch.zeros_like(states.state[index, r.slot]) if r.fresh else states.state[index, r.slot]
        out, state = _delta_rule(q[None], k[None], v[None], g[None, r.start:r.end], beta[None, r.start:r.end],
                                 state[None])
        states.state[index, r.slot] = state[0]
        core[r.start:r.end] = out[0]
    # gated RMSNorm per head, rounded to the input's dtype where transformers rounds, then out_proj
    core = core.to(x.dtype).float()
    normed = (core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    gated = (w.norm * normed) * F.silu(z.float().view(-1, la.num_v_heads, la.v_head_dim))
    gated = gated.to(x.dtype).reshape(x.shape[0], la.value_dim)
    out = w.out_proj(gated)
    _add_lora(out, gated, step.lora, (layer, "out_proj"))
    return out


def _add_lora(y: torch.Tensor, x: torch.Tensor, runs: list[LoraRun], module: tuple[int, str]) -> None:
    """y[:, :out] += each run's LoRA on ``module`` of its rows of x (y may be wider: in_proj's other parts)."""
    for start, end, rows in runs:
        lora = rows.get(module)
        if lora is not None:
            y[start:end, :lora.bt.shape[1]] += ((x[start:end] @ lora.a.t()) @ lora.bt) * lora.scaling


def _decode_rule(states: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One token of the rule for each of n sequences, in place on their states: states [slots, H, dk, dv] (a
    layer's), the sequences' slots [n], q, k [n, H, dk], v [n, H, dv], g, beta [n, H]; returns the outputs
    [n, H, dv]. The states are updated in place over the block of slots up to the highest one (a gathered
    copy would read and write every state twice more): slots of no sequence here take g = 0, beta = 0 and
    k = 0, which leaves their states exactly as they are (times exp(0), plus 0)."""
    width = int(slots.max()) + 1
    block = states[:width]                                         # [width, H, dk, dv], contiguous
    H, dk, dv = block.shape[1:]

    def spread(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros(width, *t.shape[1:])
        out[slots] = t
        return out

    q, k, v, g, beta = (spread(t) for t in (q, k, v, g, beta))
    read = torch.stack([k, q], dim=2) @ block                      # [width, H, 2, dv]: k^T S and q^T S
    decay = g.exp()
    u = beta[..., None] * (v - decay[..., None] * read[:, :, 0])   # the values written
    out = decay[..., None] * read[:, :, 1] + (q * k).sum(-1, keepdim=True) * u
    flat = block.view(width * H, dk, dv)
    flat.mul_(decay.view(-1, 1, 1)).baddbmm_(k.reshape(-1, dk, 1), u.reshape(-1, 1, dv))
    return out[slots]


def _heads(mixed: torch.Tensor, la: LinearAttention) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [n, v_heads, k_head_dim] (L2-normed, q scaled by k_head_dim ** -0.5; each key head serves
    v_heads / k_heads consecutive value heads) and v [n, v_heads, v_head_dim], in float32."""
    q, k, v = mixed.float().split([la.key_dim, la.key_dim, la.value_dim], dim=1)
    group = la.num_v_heads // la.num_k_heads
    q, k = (t.view(-1, la.num_k_heads, la.k_head_dim).repeat_interleave(group, dim=1) for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * la.k_head_dim ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q, k, v.view(-1, la.num_v_heads, la.v_head_dim)


def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over n tokens of B sequences: q, k [B, n, H, dk], v [B, n, H, dv], g, beta
    [B, n, H], state [B, H, dk, dv] (all float32) -> (outputs [B, n, H, dv], the final state).

    In a chunk starting from state S0 with cumulative log decays G_t, the values written are
    u = (I + A)^-1 (beta v - beta e^G (k S0)) with A[t, j] = beta_t e^(G_t - G_j) (k_t . k_j) for j < t;
    then o_t = e^(G_t) q_t S0 + sum_{j <= t} e^(G_t - G_j) (q_t . k_j) u_j and
    S = e^(G_last) S0 + sum_j e^(G_last - G_j) k_j u_j^T."""
    q, k, v, g, beta = (t.transpose(1, 2) for t in (q, k, v, g, beta))      # heads before tokens
    out = torch.empty_like(v)
    for s in range(0, q.shape[2], CHUNK):
        e = min(s + CHUNK, q.shape[2])
        qc, kc, vc, bc = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e, None]
        cum = g[:, :, s:e].cumsum(dim=2)                                     # [B, H, c]
        n = e - s
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()   # [B, H, c, c]
        strict = (bc * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        rhs = bc * vc - (bc * cum.exp()[..., None]) * (kc @ state)
        u = torch.linalg.solve_triangular(eye + strict, rhs, upper=False, unitriangular=True)
        out[:, :, s:e] = cum.exp()[..., None] * (qc @ state) + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        last = cum[..., -1:]                                                 # [B, H, 1]
        state = last.exp()[..., None] * state + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u
    return out.transpose(1, 2), state
