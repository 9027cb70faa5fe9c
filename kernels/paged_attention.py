"""Paged decode attention over the unified pool (one query token per sequence), GQA, online softmax.

Each program takes one sequence and one KV head with the query heads of its group, and walks the
sequence's own pages through its block table, PAGES pages per iteration, up to its context length:
rows past a context are never loaded (a page's tail may hold NaN from an adapter's weights that
owned it before, and 0 * NaN is NaN), and a sequence of context 0 (a CUDA graph's padding row)
loops zero times and writes zeros. The context length is read on the device and the grid is
(sequences, KV heads), so a launch depends on no value of the step: it can be captured in a CUDA
graph and replayed with other tables and lengths. Nothing is allocated here (``out`` is given).

    out[n, h] = softmax(scale * q[n, h] . K[ctx(n), h // group]) @ V[ctx(n), h // group]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_qn", "stride_on", "stride_tn"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, scale,
    stride_qn, stride_qh, stride_kp, stride_kb, stride_vp, stride_vb, stride_tn, stride_on, stride_oh,
    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, PAGES: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HD_P)
    gm = g < GROUP
    dm = d < HD
    heads = kvh * GROUP + g
    # q: [GROUP_P, HD_P] fp32, the group's query heads, scaled once
    q = tl.load(q_ptr + seq * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32) * scale
    m = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_P], dtype=tl.float32)
    acc = tl.zeros([GROUP_P, HD_P], dtype=tl.float32)
    slot = tl.arange(0, BLOCK_P)                     # row within a page
    pp = tl.arange(0, PAGES)                         # page within an iteration
    num_pages = tl.cdiv(ctx, BLOCK)
    for i0 in range(0, num_pages, PAGES):
        page_index = i0 + pp
        pages = tl.load(table_ptr + seq * stride_tn + page_index, mask=page_index < num_pages, other=0)
        pos = page_index[:, None] * BLOCK + slot[None, :]                    # [PAGES, BLOCK_P]
        live = tl.reshape((slot[None, :] < BLOCK) & (pos < ctx), [PAGES * BLOCK_P])
        k_rows = tl.reshape(pages[:, None] * stride_kp + slot[None, :] * stride_kb, [PAGES * BLOCK_P])
        v_rows = tl.reshape(pages[:, None] * stride_vp + slot[None, :] * stride_vb, [PAGES * BLOCK_P])
        kv_mask = live[:, None] & dm[None, :]
        # k, v: [PAGES * BLOCK_P, HD_P] of KV head kvh
        k = tl.load(k_ptr + k_rows[:, None] + kvh * HD + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                    # [GROUP_P, rows]
        s = tl.where(live[None, :], s, float("-inf"))
        # every iteration holds at least one live row (page i0 starts below ctx), so m_new is finite
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + v_rows[:, None] + kvh * HD + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_on + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> None:
    """out[n] = attention of q[n] over its sequence's first context_lens[n] cached rows, in place.

    out, q: [n, nh, hd] (unit stride in hd); k_cache, v_cache: [pool pages, block, nkv * hd] of one
    layer (rows of unit stride, any page and row strides: views of the pool's KV); block_tables:
    [n, >= pages of the longest context] int64 (unit column stride); context_lens: [n] int64, 0 for
    rows that attend to nothing (their out is 0).
    """
    n, nh, hd = q.shape
    kv_size = k_cache.shape[-1]
    nkv = kv_size // hd
    if n == 0:
        return
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 \
            or block_tables.stride(1) != 1 or nh % nkv:
        raise ValueError("paged_decode_attention needs unit-stride head dims, block tables and KV rows, "
                         f"and query heads a multiple of KV heads (q {tuple(q.shape)}, kv_size {kv_size})")
    group = nh // nkv
    block = k_cache.shape[1]
    block_p = triton.next_power_of_2(block)
    _paged_decode_kernel[(n, nkv)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK=block, BLOCK_P=block_p, PAGES=max(1, 64 // block_p),
        GROUP=group, GROUP_P=triton.next_power_of_2(group), HD=hd, HD_P=triton.next_power_of_2(hd),
    )
