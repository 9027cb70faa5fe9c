"""Tile bodies shared by the segment kernels (SGMV, MBGMM): one [BLOCK_M] block of token rows."""
import triton
import triton.language as tl


@triton.jit
def shrink_tile(x_ptr, flat_ptr, off, m, mm, jm, k_lo, k_hi, stride_xt, stride_xk,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """[BLOCK_M, BLOCK_R] fp32: rows m of x times the A rows at offsets off, over k in [k_lo, k_hi)."""
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < k_hi
        # xt: [BLOCK_M, BLOCK_K]; wt: [BLOCK_K, BLOCK_R], a tile of A^T gathered by row offsets
        xt = tl.load(x_ptr + m[:, None] * stride_xt + k[None, :] * stride_xk,
                     mask=mm[:, None] & km[None, :], other=0.0)
        wt = tl.load(flat_ptr + off[None, :] + k[:, None], mask=km[:, None] & jm[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, wt)
    return acc


@triton.jit
def expand_tile(s_ptr, flat_ptr, b_row_ptr, m, mm, n, nm, r, stride_st, stride_bj,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32: rows m of s [.., r] times the B^T rows whose offsets start at b_row_ptr."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j0 in range(0, r, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        jm = j < r
        off = tl.load(b_row_ptr + j * stride_bj, mask=jm, other=0)
        # st: [BLOCK_M, BLOCK_R] fp32 shrink result; wt: [BLOCK_R, BLOCK_N] rows of B^T
        st = tl.load(s_ptr + m[:, None] * stride_st + j[None, :], mask=mm[:, None] & jm[None, :], other=0.0)
        wt = tl.load(flat_ptr + off[:, None] + n[None, :], mask=jm[:, None] & nm[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(st, wt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(st.to(wt.dtype), wt)
    return acc
