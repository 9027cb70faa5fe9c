"""kernels.paged_attention against a float64 reference, on the pool's KV layout (TRITON_INTERPRET=1 on
CPU; ASYNCSERVE_TEST_DEVICE=cuda compiles it on a GPU)."""
import math

import pytest
import torch

import kernels  # noqa: F401  (switches the interpreter on without CUDA)
from kernels.paged_attention import paged_decode_attention
from reference import TEST_DEVICE


def _reference(q, k_cache, v_cache, tables, lens, scale):
    """float64: each sequence's context rows gathered through its table, softmax, weighted sum."""
    n, nh, hd = q.shape
    nkv = k_cache.shape[-1] // hd
    block = k_cache.shape[1]
    out = torch.zeros(n, nh, hd, dtype=torch.float64)
    for i in range(n):
        ctx = int(lens[i])
        if ctx == 0:
            continue
        pages = tables[i, :math.ceil(ctx / block)].cpu()
        k = k_cache.cpu()[pages].reshape(-1, nkv, hd)[:ctx].double()
        v = v_cache.cpu()[pages].reshape(-1, nkv, hd)[:ctx].double()
        for h in range(nh):
            kv = h // (nh // nkv)
            w = torch.softmax(k[:, kv] @ q[i, h].cpu().double() * scale, dim=0)
            out[i, h] = w @ v[:, kv]
    return out


@pytest.mark.parametrize("nh,nkv,hd,block,dtype", [
    (4, 2, 16, 4, torch.float32),        # GQA groups of 2, small pages: many page steps
    (6, 2, 8, 16, torch.float32),        # group of 3 (padded to 4 in the kernel), head dim 8
    (4, 4, 32, 8, torch.bfloat16),       # no grouping, bf16 cache
    (8, 1, 16, 5, torch.float32),        # one KV head, a page size that is no power of two
])
def test_paged_decode_attention_matches_float64(nh, nkv, hd, block, dtype):
    torch.manual_seed(0)
    device = torch.device(TEST_DEVICE)
    layers, pages = 2, 40
    # the pool's KV view [pages, 2, layers, block, kv_size], NaN everywhere (an earlier owner's rows)
    kv = torch.full((pages, 2, layers, block, nkv * hd), float("nan"), dtype=dtype, device=device)
    # contexts: 1 row, a page exactly, one past a page, several pages, 0 (a graph's padding row)
    lens = [1, block, block + 1, 5 * block - 1, 3 * block + 2, 0, 7 * block]
    width = max(math.ceil(c / block) for c in lens) + 1
    perm = torch.randperm(pages - 1) + 1
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    used = 0
    for i, ctx in enumerate(lens):
        own = math.ceil(ctx / block)
        tables[i, :own] = perm[used:used + own]
        used += own
        for j in range(ctx):                 # only the context rows get values
            page, slot = tables[i, j // block], j % block
            kv[page, :, :, slot] = torch.randn(2, layers, nkv * hd, dtype=torch.float32).to(dtype)
    tables = tables.to(device)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    # q as the model has it: a head slice of a wider [T, heads, hd] tensor
    qk = torch.randn(len(lens), nh + nkv, hd, dtype=torch.float32).to(dtype).to(device)
    q = qk[:, :nh]
    scale = hd ** -0.5
    for layer in range(layers):
        k_cache, v_cache = kv[:, 0, layer], kv[:, 1, layer]
        out = torch.full((len(lens), nh, hd), float("nan"), dtype=dtype, device=device)
        paged_decode_attention(out, q, k_cache, v_cache, tables, lens_t, scale)
        want = _reference(q, k_cache, v_cache, tables, lens_t, scale)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)
        assert out[lens.index(0)].abs().max() == 0
