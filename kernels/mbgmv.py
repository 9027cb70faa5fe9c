"""MBGMV (S-LoRA §5.3) and padded BGMV (Punica) for decode: one token per row, own adapter per token.

Both read adapter rows in place from the paged pool through per-row offsets:

    shrink  s[t, j] = x[t] . A_a[j]                       j < r_a        (A row: `in` elements)
    expand  y[t, :] += scaling[a] * sum_j s[t, j] B^T_a[j]   j < r_a     (B^T row: `out` elements)

MBGMV visits only rows j < r_a of token t's adapter, so its work is sum over tokens of r_a
(CaraServe's Perf_MBGMV = a * sum(rank) + b). BGMV (``padded=True``) runs every token to the table
width R (the batch's max rank): rows j >= r_a are loaded from a dummy row (pool offset 0) and
masked to zero afterwards, so instructions and loads grow as |tokens| * R like a padded
``[n, R, in]`` layout (Perf_BGMV = a * |S| * max rank + b); the dummy loads hit cache where real
padding would read zeros from DRAM, so this is a lower bound on the padded kernel's cost.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._util import block_size, check_scratch, pick_split_k

BLOCK_R = 16


# Triton compiles a kernel per set of constexprs, integer arguments' specializations (== 1, divisible
# by 16) and pointers' alignments. Arguments that follow the step (the split-K factor, the step's max
# rank and the table strides and scratch width that come from it) are left unspecialized, so a kernel
# compiles once per projection group, not once per batch size or rank mix, and TritonLoraBackend.warm_up
# can compile them all at start. Specialized, decode steps of 1..64 tokens and three rank mixes compiled
# 74 of this kernel (the sweep of tests/test_kernel_variants.py), and on an H100 the first pass of a
# 1,000-adapter trace stalled 20 steps by 0.2-4.2 s (BENCHMARKS.md). Weight rows come through offsets
# loaded from the tables, whose alignment no specialization could know, so their loads lose nothing.
@triton.jit(do_not_specialize=["R", "SPLIT_K", "stride_an", "stride_ap", "stride_st"],
            do_not_specialize_on_alignment=["a_ptr"])
def _mbgmv_shrink_kernel(
    x_ptr, flat_ptr, a_ptr, rank_ptr, tok_ptr, s_ptr,
    IN, R, SPLIT_K,
    stride_xt, stride_xk, stride_an, stride_ap, stride_aj, stride_rn, stride_rp, stride_st,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, PADDED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)     # 64-bit row offsets: T * stride may pass 2^31
    rb = tl.program_id(1)
    p = tl.program_id(2) // SPLIT_K       # projection of a fused group (all read the same x)
    ks = tl.program_id(2) % SPLIT_K
    a = tl.load(tok_ptr + t)
    if a < 0:
        return
    r = tl.load(rank_ptr + a * stride_rn + p * stride_rp)
    a_ptr += p * stride_ap
    s_ptr += p * R                        # s row: [projection, R] blocks side by side
    j = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    if PADDED:
        rows = j < R
    else:
        if rb * BLOCK_R >= r:
            return
        rows = j < r
    live = j < r
    off = tl.load(a_ptr + a * stride_an + j * stride_aj, mask=rows, other=0)
    if PADDED:
        off = tl.where(live, off, 0)
    # this program's share of the reduction (split-K)
    k_chunk = tl.cdiv(tl.cdiv(IN, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = ks * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, IN)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < k_hi
        # xv: [BLOCK_K], w: [BLOCK_R, BLOCK_K] gathered rows of A
        xv = tl.load(x_ptr + t * stride_xt + k * stride_xk, mask=km, other=0.0).to(tl.float32)
        w = tl.load(flat_ptr + off[:, None] + k[None, :], mask=rows[:, None] & km[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
    if PADDED:
        acc = tl.where(live, acc, 0.0)
    if ATOMIC:
        tl.atomic_add(s_ptr + t * stride_st + j, acc, mask=rows)
    else:
        tl.store(s_ptr + t * stride_st + j, acc, mask=rows)


@triton.jit(do_not_specialize=["R", "stride_st", "stride_bn", "stride_bp"],
            do_not_specialize_on_alignment=["b_ptr", "scale_ptr"])
def _mbgmv_expand_kernel(
    s_ptr, flat_ptr, b_ptr, rank_ptr, scale_ptr, tok_ptr, y_ptr,
    OUT0, OUT1, OUT2, R,
    stride_st, stride_bn, stride_bp, stride_bj, stride_rn, stride_rp, stride_cn, stride_cp,
    stride_yt, stride_yn,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PADDED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)     # 64-bit row offsets: T * stride may pass 2^31
    nb = tl.program_id(1)
    p = tl.program_id(2)                  # projection p writes columns [col0, col0 + OUT) of y
    OUT = tl.where(p == 0, OUT0, tl.where(p == 1, OUT1, OUT2))
    col0 = tl.where(p == 0, 0, tl.where(p == 1, OUT0, OUT0 + OUT1))
    if nb * BLOCK_N >= OUT:
        return
    a = tl.load(tok_ptr + t)
    if a < 0:
        return
    r = tl.load(rank_ptr + a * stride_rn + p * stride_rp)
    if r == 0:
        return
    b_ptr += p * stride_bp
    s_ptr += p * R
    scale_ptr += p * stride_cp
    y_ptr += col0 * stride_yn
    if PADDED:
        r_loop = R
    else:
        r_loop = r
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < OUT
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in range(0, r_loop, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        rows = j < r_loop
        live = j < r
        off = tl.load(b_ptr + a * stride_bn + j * stride_bj, mask=rows, other=0)
        if PADDED:
            off = tl.where(live, off, 0)
        sv = tl.load(s_ptr + t * stride_st + j, mask=rows, other=0.0)
        # w: [BLOCK_R, BLOCK_N] gathered rows of B^T
        w = tl.load(flat_ptr + off[:, None] + n[None, :], mask=rows[:, None] & nm[None, :], other=0.0)
        prod = w.to(tl.float32) * sv[:, None]
        if PADDED:
            prod = tl.where(live[:, None], prod, 0.0)
        acc += tl.sum(prod, axis=0)
    scale = tl.load(scale_ptr + a * stride_cn)
    y_ptrs = y_ptr + t * stride_yt + n * stride_yn
    yv = tl.load(y_ptrs, mask=nm, other=0.0)
    tl.store(y_ptrs, (yv.to(tl.float32) + acc * scale).to(y_ptr.dtype.element_ty), mask=nm)


def mbgmv_shrink(x: torch.Tensor, flat: torch.Tensor, a_ptr: torch.Tensor, ranks: torch.Tensor,
                 token_adapter: torch.Tensor, s: torch.Tensor, *, split_k: int | None = None,
                 padded: bool = False) -> None:
    """s[t, :r_a] = x[t] @ A_a[:r_a]^T for tokens with adapter a >= 0; other entries of s undefined.

    x: [T, in] (any strides); flat: pool.flat; a_ptr: [n, R] int64 row offsets (any strides);
    ranks: [n] int32; token_adapter: [T] int32 (-1 = none); s: [>=T, >=R] float32, unit column stride.
    Fused group (projections sharing x, e.g. q, k, v): a_ptr [n, P, R] and ranks [n, P], P <= 3;
    projection p's result lands in s[t, p*R : p*R + r].
    split_k > 1 accumulates partial sums atomically (s is zeroed first); None picks it from the grid.
    """
    a3, r2 = _as_group(a_ptr, ranks)
    tokens, fan_in = x.shape
    n_proj, r_table = a3.shape[1], a3.shape[2]
    check_scratch(s, tokens, n_proj * r_table)
    if tokens == 0 or r_table == 0:
        return
    r_blocks = triton.cdiv(r_table, BLOCK_R)
    if split_k is None:
        split_k = pick_split_k(x.device, tokens * r_blocks * n_proj, triton.cdiv(fan_in, 256))
    split_k = min(split_k, triton.cdiv(fan_in, 16))
    block_k = block_size(triton.cdiv(fan_in, split_k), 256)   # every split gets work
    if split_k > 1:
        s[:tokens, :n_proj * r_table].zero_()
    _mbgmv_shrink_kernel[(tokens, r_blocks, n_proj * split_k)](
        x, flat, a3, r2, token_adapter, s,
        fan_in, r_table, split_k,
        x.stride(0), x.stride(1), a3.stride(0), a3.stride(1), a3.stride(2), r2.stride(0), r2.stride(1),
        s.stride(0),
        BLOCK_R=BLOCK_R, BLOCK_K=block_k, ATOMIC=split_k > 1, PADDED=padded,
    )


def mbgmv_expand(s: torch.Tensor, flat: torch.Tensor, b_ptr: torch.Tensor, ranks: torch.Tensor,
                 scaling: torch.Tensor, token_adapter: torch.Tensor, y: torch.Tensor, *,
                 out_sizes: tuple[int, ...] | None = None, padded: bool = False) -> None:
    """y[t] += scaling[a] * s[t, :r_a] @ B^T_a[:r_a] for tokens with adapter a >= 0, in place.

    s: from mbgmv_shrink; b_ptr: [n, R] int64; scaling: [n] float32 (any stride);
    y: [T, out] (any strides: a column slice of a fused output is fine); other tokens untouched.
    Fused group: b_ptr [n, P, R], ranks and scaling [n, P], out_sizes the P projections' widths,
    whose columns lie side by side in y (sum(out_sizes) == y.shape[1]).
    """
    b3, r2 = _as_group(b_ptr, ranks)
    c2 = scaling if scaling.dim() == 2 else scaling[:, None]
    tokens = y.shape[0]
    n_proj, r_table = b3.shape[1], b3.shape[2]
    sizes = tuple(out_sizes) if out_sizes is not None else (y.shape[1],)
    if len(sizes) != n_proj or sum(sizes) != y.shape[1] or n_proj > 3:
        raise ValueError(f"out_sizes {sizes} must give one width per projection (at most 3) summing to "
                         f"y's {y.shape[1]} columns; b_ptr has {n_proj} projections")
    check_scratch(s, tokens, n_proj * r_table)
    if tokens == 0 or r_table == 0:
        return
    block_n = block_size(max(sizes), 256)
    o = sizes + (0,) * (3 - n_proj)
    _mbgmv_expand_kernel[(tokens, triton.cdiv(max(sizes), block_n), n_proj)](
        s, flat, b3, r2, c2, token_adapter, y,
        o[0], o[1], o[2], r_table,
        s.stride(0), b3.stride(0), b3.stride(1), b3.stride(2), r2.stride(0), r2.stride(1),
        c2.stride(0), c2.stride(1), y.stride(0), y.stride(1),
        BLOCK_R=BLOCK_R, BLOCK_N=block_n, PADDED=padded,
    )


def _as_group(ptr: torch.Tensor, ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's [n, R] / [n] tables as a group of one: [n, 1, R] / [n, 1]."""
    return (ptr, ranks) if ptr.dim() == 3 else (ptr[:, None, :], ranks[:, None])


def bgmv_shrink(x, flat, a_ptr, ranks, token_adapter, s, *, split_k: int | None = None) -> None:
    """Padded BGMV shrink: mbgmv_shrink's result at |tokens| x R cost (R = a_ptr.shape[1])."""
    mbgmv_shrink(x, flat, a_ptr, ranks, token_adapter, s, split_k=split_k, padded=True)


def bgmv_expand(s, flat, b_ptr, ranks, scaling, token_adapter, y) -> None:
    """Padded BGMV expand: mbgmv_expand's result at |tokens| x R cost."""
    mbgmv_expand(s, flat, b_ptr, ranks, scaling, token_adapter, y, padded=True)
