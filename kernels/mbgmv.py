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


@triton.jit
def _mbgmv_shrink_kernel(
    x_ptr, flat_ptr, a_ptr, rank_ptr, tok_ptr, s_ptr,
    IN, R,
    stride_xt, stride_xk, stride_an, stride_aj, stride_rn, stride_st,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PADDED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)     # 64-bit row offsets: T * stride may pass 2^31
    rb = tl.program_id(1)
    ks = tl.program_id(2)
    a = tl.load(tok_ptr + t)
    if a < 0:
        return
    r = tl.load(rank_ptr + a * stride_rn)
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
    if SPLIT_K == 1:
        tl.store(s_ptr + t * stride_st + j, acc, mask=rows)
    else:
        tl.atomic_add(s_ptr + t * stride_st + j, acc, mask=rows)


@triton.jit
def _mbgmv_expand_kernel(
    s_ptr, flat_ptr, b_ptr, rank_ptr, scale_ptr, tok_ptr, y_ptr,
    OUT, R,
    stride_st, stride_bn, stride_bj, stride_rn, stride_cn, stride_yt, stride_yn,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PADDED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)     # 64-bit row offsets: T * stride may pass 2^31
    nb = tl.program_id(1)
    a = tl.load(tok_ptr + t)
    if a < 0:
        return
    r = tl.load(rank_ptr + a * stride_rn)
    if r == 0:
        return
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
    split_k > 1 accumulates partial sums atomically (s is zeroed first); None picks it from the grid.
    """
    tokens, fan_in = x.shape
    r_table = a_ptr.shape[1]
    check_scratch(s, tokens, r_table)
    if tokens == 0 or r_table == 0:
        return
    r_blocks = triton.cdiv(r_table, BLOCK_R)
    if split_k is None:
        split_k = pick_split_k(x.device, tokens * r_blocks, triton.cdiv(fan_in, 256))
    split_k = min(split_k, triton.cdiv(fan_in, 16))
    block_k = block_size(triton.cdiv(fan_in, split_k), 256)   # every split gets work
    if split_k > 1:
        s[:tokens, :r_table].zero_()
    _mbgmv_shrink_kernel[(tokens, r_blocks, split_k)](
        x, flat, a_ptr, ranks, token_adapter, s,
        fan_in, r_table,
        x.stride(0), x.stride(1), a_ptr.stride(0), a_ptr.stride(1), ranks.stride(0), s.stride(0),
        BLOCK_R=BLOCK_R, BLOCK_K=block_k, SPLIT_K=split_k, PADDED=padded,
    )


def mbgmv_expand(s: torch.Tensor, flat: torch.Tensor, b_ptr: torch.Tensor, ranks: torch.Tensor,
                 scaling: torch.Tensor, token_adapter: torch.Tensor, y: torch.Tensor, *,
                 padded: bool = False) -> None:
    """y[t] += scaling[a] * s[t, :r_a] @ B^T_a[:r_a] for tokens with adapter a >= 0, in place.

    s: from mbgmv_shrink; b_ptr: [n, R] int64; scaling: [n] float32 (any stride);
    y: [T, out] (any strides: a column slice of a fused output is fine); other tokens untouched.
    """
    tokens, fan_out = y.shape
    r_table = b_ptr.shape[1]
    check_scratch(s, tokens, r_table)
    if tokens == 0 or r_table == 0:
        return
    block_n = block_size(fan_out, 256)
    _mbgmv_expand_kernel[(tokens, triton.cdiv(fan_out, block_n))](
        s, flat, b_ptr, ranks, scaling, token_adapter, y,
        fan_out, r_table,
        s.stride(0), b_ptr.stride(0), b_ptr.stride(1), ranks.stride(0), scaling.stride(0),
        y.stride(0), y.stride(1),
        BLOCK_R=BLOCK_R, BLOCK_N=block_n, PADDED=padded,
    )


def bgmv_shrink(x, flat, a_ptr, ranks, token_adapter, s, *, split_k: int | None = None) -> None:
    """Padded BGMV shrink: mbgmv_shrink's result at |tokens| x R cost (R = a_ptr.shape[1])."""
    mbgmv_shrink(x, flat, a_ptr, ranks, token_adapter, s, split_k=split_k, padded=True)


def bgmv_expand(s, flat, b_ptr, ranks, scaling, token_adapter, y) -> None:
    """Padded BGMV expand: mbgmv_expand's result at |tokens| x R cost."""
    mbgmv_expand(s, flat, b_ptr, ranks, scaling, token_adapter, y, padded=True)
