"""MBGMM (S-LoRA §5.3) for prefill and mixed steps: tiled gather matrix-matrix products.

Where SGMV gives each segment one program column that walks all its tokens, MBGMM cuts every
segment into BLOCK_M-token tiles on the host (``mbgmm_tiles``, once per step) and gives each tile
its own programs, so one long prompt spreads over the whole GPU and short segments cost one tile.
A tile never crosses a segment, so it has one adapter and one rank; rank tiles beyond that rank
exit at once and the expand loop stops at it (no padding to the batch's max rank).

    shrink  s[t, :r] = x[t] @ A_a[:r]^T                  grid (tile, rank block)
    expand  y[t] += scaling[a] * s[t, :r] @ B^T_a[:r]    grid (tile, output block)
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._tiles import expand_tile, shrink_tile
from kernels._util import block_size, check_scratch, dot_in_fp32

BLOCK_R = 16


class MbgmmTiles(NamedTuple):
    table: torch.Tensor      # [n_tiles, 3] int32: (first token, end token, adapter)
    block_m: int


def mbgmm_tiles(seg_starts: list[int], seg_adapter: list[int], device: torch.device | str,
                block_m: int = 32) -> MbgmmTiles:
    """Token tiles of the segments that have an adapter (host lists in, one small copy out)."""
    rows = []
    for s, a in enumerate(seg_adapter):
        if a < 0:
            continue
        for start in range(seg_starts[s], seg_starts[s + 1], block_m):
            rows.append((start, min(start + block_m, seg_starts[s + 1]), a))
    table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 3)
    return MbgmmTiles(table.to(device), block_m)


# what follows the step is left unspecialized (see mbgmv.py)
@triton.jit(do_not_specialize=["stride_an", "stride_st"], do_not_specialize_on_alignment=["a_ptr"])
def _mbgmm_shrink_kernel(
    x_ptr, flat_ptr, a_ptr, rank_ptr, tile_ptr, s_ptr,
    IN,
    stride_xt, stride_xk, stride_an, stride_aj, stride_rn, stride_st,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    rb = tl.program_id(1)
    a = tl.load(tile_ptr + tile * 3 + 2)
    r = tl.load(rank_ptr + a * stride_rn)
    if rb * BLOCK_R >= r:
        return
    start = tl.load(tile_ptr + tile * 3).to(tl.int64)   # 64-bit row offsets: T * stride may pass 2^31
    end = tl.load(tile_ptr + tile * 3 + 1).to(tl.int64)
    m = start + tl.arange(0, BLOCK_M)
    mm = m < end
    j = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    jm = j < r
    off = tl.load(a_ptr + a * stride_an + j * stride_aj, mask=jm, other=0)
    acc = shrink_tile(x_ptr, flat_ptr, off, m, mm, jm, 0, IN, stride_xt, stride_xk,
                      BLOCK_M, BLOCK_R, BLOCK_K, DOT_F32)
    tl.store(s_ptr + m[:, None] * stride_st + j[None, :], acc, mask=mm[:, None] & jm[None, :])


@triton.jit(do_not_specialize=["stride_st", "stride_bn"], do_not_specialize_on_alignment=["b_ptr", "scale_ptr"])
def _mbgmm_expand_kernel(
    s_ptr, flat_ptr, b_ptr, rank_ptr, scale_ptr, tile_ptr, y_ptr,
    OUT,
    stride_st, stride_bn, stride_bj, stride_rn, stride_cn, stride_yt, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    a = tl.load(tile_ptr + tile * 3 + 2)
    r = tl.load(rank_ptr + a * stride_rn)
    if r == 0:
        return
    start = tl.load(tile_ptr + tile * 3).to(tl.int64)   # 64-bit row offsets: T * stride may pass 2^31
    end = tl.load(tile_ptr + tile * 3 + 1).to(tl.int64)
    m = start + tl.arange(0, BLOCK_M)
    mm = m < end
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < OUT
    acc = expand_tile(s_ptr, flat_ptr, b_ptr + a * stride_bn, m, mm, n, nm, r, stride_st, stride_bj,
                      BLOCK_M, BLOCK_R, BLOCK_N, DOT_F32)
    scale = tl.load(scale_ptr + a * stride_cn)
    y_ptrs = y_ptr + m[:, None] * stride_yt + n[None, :] * stride_yn
    ym = mm[:, None] & nm[None, :]
    yv = tl.load(y_ptrs, mask=ym, other=0.0)
    tl.store(y_ptrs, (yv.to(tl.float32) + acc * scale).to(y_ptr.dtype.element_ty), mask=ym)


def mbgmm_shrink(x: torch.Tensor, flat: torch.Tensor, a_ptr: torch.Tensor, ranks: torch.Tensor,
                 tiles: MbgmmTiles, s: torch.Tensor) -> None:
    """s[t, :r_a] = x[t] @ A_a[:r_a]^T for the tokens of ``tiles``.

    x: [T, in] (any strides); flat: pool.flat; a_ptr: [n, R] int64 (any strides); ranks: [n] int32;
    tiles: from mbgmm_tiles; s: [>=T, >=R] float32, unit column stride.
    """
    tokens, fan_in = x.shape
    n_tiles = tiles.table.shape[0]
    r_table = a_ptr.shape[1]
    check_scratch(s, tokens, r_table)
    if n_tiles == 0 or r_table == 0:
        return
    _mbgmm_shrink_kernel[(n_tiles, triton.cdiv(r_table, BLOCK_R))](
        x, flat, a_ptr, ranks, tiles.table, s,
        fan_in,
        x.stride(0), x.stride(1), a_ptr.stride(0), a_ptr.stride(1), ranks.stride(0), s.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_R=BLOCK_R, BLOCK_K=block_size(fan_in, 64),
        DOT_F32=dot_in_fp32(x.dtype, flat.dtype),
    )


def mbgmm_expand(s: torch.Tensor, flat: torch.Tensor, b_ptr: torch.Tensor, ranks: torch.Tensor,
                 scaling: torch.Tensor, tiles: MbgmmTiles, y: torch.Tensor) -> None:
    """y[t] += scaling[a] * s[t, :r_a] @ B^T_a[:r_a] for the tokens of ``tiles``, in place.

    b_ptr: [n, R] int64; scaling: [n] float32 (any stride); y: [T, out] (any strides).
    """
    tokens, fan_out = y.shape
    n_tiles = tiles.table.shape[0]
    r_table = b_ptr.shape[1]
    check_scratch(s, tokens, r_table)
    if n_tiles == 0 or r_table == 0:
        return
    block_n = block_size(fan_out, 64)
    _mbgmm_expand_kernel[(n_tiles, triton.cdiv(fan_out, block_n))](
        s, flat, b_ptr, ranks, scaling, tiles.table, y,
        fan_out,
        s.stride(0), b_ptr.stride(0), b_ptr.stride(1), ranks.stride(0), scaling.stride(0),
        y.stride(0), y.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_R=BLOCK_R, BLOCK_N=block_n, DOT_F32=dot_in_fp32(y.dtype, flat.dtype),
    )
