"""Punica's SGMV (§4) over the paged pool: one program column per segment of same-adapter tokens.

Segments are ``seg_starts [S+1]`` token boundaries and ``seg_adapter [S]`` (-1: skip). The grid is
(segment, rank or output tile[, K split]) and each program walks its segment's tokens in BLOCK_M
tiles with tensor-core dots, so a segment's weights are read once per tile from L2, not per token.

* shrink ``s[t, :r] = x[t] @ A_a[:r]^T``: the output is thin (the rank), so the reduction over
  ``in`` is split across programs (split-K) whose partial sums are added atomically into ``s``.
* expand ``y[t] += scaling[a] * s[t, :r] @ B^T_a[:r]``: the output is split in BLOCK_N columns.

Rank tiles beyond an adapter's rank exit at once, and the expand loop stops at the rank: work is
proportional to each segment's own rank (rounded up to BLOCK_R), never to the batch's max rank.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._tiles import expand_tile, shrink_tile
from kernels._util import block_size, check_scratch, dot_in_fp32, pick_split_k

BLOCK_M = 16
BLOCK_R = 16


# what follows the step is left unspecialized (see mbgmv.py): specialized, steps of 1..48 segments and
# three rank mixes compiled 86 of this kernel
@triton.jit(do_not_specialize=["SPLIT_K", "stride_an", "stride_st"], do_not_specialize_on_alignment=["a_ptr"])
def _sgmv_shrink_kernel(
    x_ptr, flat_ptr, a_ptr, rank_ptr, seg_ptr, seg_adapter_ptr, s_ptr,
    IN, SPLIT_K,
    stride_xt, stride_xk, stride_an, stride_aj, stride_rn, stride_st,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    seg = tl.program_id(0)
    rb = tl.program_id(1)
    ks = tl.program_id(2)
    a = tl.load(seg_adapter_ptr + seg)
    if a < 0:
        return
    r = tl.load(rank_ptr + a * stride_rn)
    if rb * BLOCK_R >= r:
        return
    start = tl.load(seg_ptr + seg).to(tl.int64)      # 64-bit row offsets: T * stride may pass 2^31
    end = tl.load(seg_ptr + seg + 1).to(tl.int64)
    j = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    jm = j < r
    off = tl.load(a_ptr + a * stride_an + j * stride_aj, mask=jm, other=0)
    k_chunk = tl.cdiv(tl.cdiv(IN, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = ks * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, IN)
    for m0 in range(start, end, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        mm = m < end
        acc = shrink_tile(x_ptr, flat_ptr, off, m, mm, jm, k_lo, k_hi, stride_xt, stride_xk,
                          BLOCK_M, BLOCK_R, BLOCK_K, DOT_F32)
        s_ptrs = s_ptr + m[:, None] * stride_st + j[None, :]
        if ATOMIC:
            tl.atomic_add(s_ptrs, acc, mask=mm[:, None] & jm[None, :])
        else:
            tl.store(s_ptrs, acc, mask=mm[:, None] & jm[None, :])


@triton.jit(do_not_specialize=["stride_st", "stride_bn"], do_not_specialize_on_alignment=["b_ptr", "scale_ptr"])
def _sgmv_expand_kernel(
    s_ptr, flat_ptr, b_ptr, rank_ptr, scale_ptr, seg_ptr, seg_adapter_ptr, y_ptr,
    OUT,
    stride_st, stride_bn, stride_bj, stride_rn, stride_cn, stride_yt, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    seg = tl.program_id(0)
    nb = tl.program_id(1)
    a = tl.load(seg_adapter_ptr + seg)
    if a < 0:
        return
    r = tl.load(rank_ptr + a * stride_rn)
    if r == 0:
        return
    start = tl.load(seg_ptr + seg).to(tl.int64)      # 64-bit row offsets: T * stride may pass 2^31
    end = tl.load(seg_ptr + seg + 1).to(tl.int64)
    scale = tl.load(scale_ptr + a * stride_cn)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < OUT
    for m0 in range(start, end, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        mm = m < end
        acc = expand_tile(s_ptr, flat_ptr, b_ptr + a * stride_bn, m, mm, n, nm, r, stride_st, stride_bj,
                          BLOCK_M, BLOCK_R, BLOCK_N, DOT_F32)
        y_ptrs = y_ptr + m[:, None] * stride_yt + n[None, :] * stride_yn
        ym = mm[:, None] & nm[None, :]
        yv = tl.load(y_ptrs, mask=ym, other=0.0)
        tl.store(y_ptrs, (yv.to(tl.float32) + acc * scale).to(y_ptr.dtype.element_ty), mask=ym)


def sgmv_shrink(x: torch.Tensor, flat: torch.Tensor, a_ptr: torch.Tensor, ranks: torch.Tensor,
                seg_starts: torch.Tensor, seg_adapter: torch.Tensor, s: torch.Tensor, *,
                split_k: int | None = None) -> None:
    """s[t, :r_a] = x[t] @ A_a[:r_a]^T for tokens of segments with adapter a >= 0.

    x: [T, in] (any strides); flat: pool.flat; a_ptr: [n, R] int64 (any strides); ranks: [n] int32;
    seg_starts: [S+1] int32; seg_adapter: [S] int32; s: [>=T, >=R] float32, unit column stride.
    split_k > 1 adds partial sums atomically (s is zeroed first); None picks it from the grid.
    """
    tokens, fan_in = x.shape
    segments = seg_adapter.shape[0]
    r_table = a_ptr.shape[1]
    check_scratch(s, tokens, r_table)
    if tokens == 0 or segments == 0 or r_table == 0:
        return
    r_blocks = triton.cdiv(r_table, BLOCK_R)
    if split_k is None:
        split_k = pick_split_k(x.device, segments * r_blocks, triton.cdiv(fan_in, 128))
    split_k = min(split_k, triton.cdiv(fan_in, 16))
    block_k = block_size(triton.cdiv(fan_in, split_k), 128)   # every split gets work
    if split_k > 1:
        s[:tokens, :r_table].zero_()
    _sgmv_shrink_kernel[(segments, r_blocks, split_k)](
        x, flat, a_ptr, ranks, seg_starts, seg_adapter, s,
        fan_in, split_k,
        x.stride(0), x.stride(1), a_ptr.stride(0), a_ptr.stride(1), ranks.stride(0), s.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=block_k, ATOMIC=split_k > 1,
        DOT_F32=dot_in_fp32(x.dtype, flat.dtype),
    )


def sgmv_expand(s: torch.Tensor, flat: torch.Tensor, b_ptr: torch.Tensor, ranks: torch.Tensor,
                scaling: torch.Tensor, seg_starts: torch.Tensor, seg_adapter: torch.Tensor,
                y: torch.Tensor) -> None:
    """y[t] += scaling[a] * s[t, :r_a] @ B^T_a[:r_a] for tokens of segments with adapter a >= 0.

    b_ptr: [n, R] int64; scaling: [n] float32 (any stride); y: [T, out] (any strides).
    """
    tokens, fan_out = y.shape
    segments = seg_adapter.shape[0]
    r_table = b_ptr.shape[1]
    check_scratch(s, tokens, r_table)
    if tokens == 0 or segments == 0 or r_table == 0:
        return
    block_n = block_size(fan_out, 128)
    _sgmv_expand_kernel[(segments, triton.cdiv(fan_out, block_n))](
        s, flat, b_ptr, ranks, scaling, seg_starts, seg_adapter, y,
        fan_out,
        s.stride(0), b_ptr.stride(0), b_ptr.stride(1), ranks.stride(0), scaling.stride(0),
        y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=block_n, DOT_F32=dot_in_fp32(y.dtype, flat.dtype),
    )
