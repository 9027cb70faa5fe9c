"""The native CPU kernels (kernels/cpu) against float64 references, and the engine with them against
the eager path and transformers+PEFT.

They run whenever the library can be built (as in CI, where scripts/setup.sh builds it), also under
ASYNCSERVE_NATIVE=0, which only keeps the model off them; they skip, saying why, only without a
working compiler.
"""
import math
import random

import pytest
import torch

import kernels.cpu as cpu_kernels
from asyncserve import LLM, SamplingParams
from reference import (ADAPTERS, assert_greedy_matches, record_calls, reference_greedy, require_native_kernels,
                       run_merged)

DTYPES = [torch.float32, torch.bfloat16]
# output tolerance relative to the values' scale: fp32 accumulation either way, bf16 rounds the result
ATOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


def at_thread_counts(counts=(1, 2)):
    """Yields each torch thread count in turn (set for the loop's body), then restores the old one."""
    threads = torch.get_num_threads()
    try:
        for t in counts:
            torch.set_num_threads(t)
            yield t
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def native():
    require_native_kernels()


# ---- paged decode attention ----------------------------------------------------------------------

def make_pool(g, pages, layers, block, kv_size, dtype):
    """A KV pool as the model sees it, [pages, 2, layers, block, kv_size], all NaN: a kernel that
    reads one slot nobody wrote returns NaN."""
    return torch.full((pages, 2, layers, block, kv_size), float("nan"), dtype=dtype)


def fill_contexts(g, kv, layer, context_lens, dtype):
    """Give each sequence random pages from the pool (shuffled, so tables are not in order), write
    K and V into its first ctx slots only, and return the padded tables and its K, V in float64."""
    pages, block, kv_size = kv.shape[0], kv.shape[3], kv.shape[4]
    need = [-(-n // block) for n in context_lens]
    order = torch.randperm(pages, generator=g).tolist()
    width = max(need)
    tables, contexts = [], []
    for n, p in zip(context_lens, need):
        table, order = order[:p], order[p:]
        k = torch.randn(n, kv_size, generator=g).to(dtype)
        v = torch.randn(n, kv_size, generator=g).to(dtype)
        for t in range(n):
            kv[table[t // block], 0, layer, t % block] = k[t]
            kv[table[t // block], 1, layer, t % block] = v[t]
        tables.append(table + [0] * (width - p))     # padding: page 0, like the runner's tables
        contexts.append((k.double(), v.double()))
    return torch.tensor(tables, dtype=torch.int64), contexts


def capped(scores, softcap):
    """Gemma 2's soft-capping of attention scores (None: none)."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def reference_decode(q, contexts, nkv, scale, window=None, softcap=None):
    """q: [n, nh, hd] float64; contexts: per sequence (k, v) [ctx, nkv * hd]; window: each query sees
    its context's last `window` rows. Returns [n, nh, hd]."""
    n, nh, hd = q.shape
    group = nh // nkv
    out = torch.empty(n, nh, hd, dtype=torch.float64)
    for i, (k, v) in enumerate(contexts):
        k, v = k.view(-1, nkv, hd), v.view(-1, nkv, hd)
        if window is not None:
            k, v = k[-window:], v[-window:]
        for h in range(nh):
            probs = torch.softmax(capped(k[:, h // group] @ q[i, h] * scale, softcap), dim=0)
            out[i, h] = probs @ v[:, h // group]
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nh, nkv, hd, block, context_lens", [
    (9, 3, 64, 16, [1, 15, 16, 17, 33, 130, 300, 2048]),       # SmolLM2's heads (head_dim 64 compiled)
    (6, 2, 24, 5, [1, 4, 5, 6, 11, 49]),                       # odd block size, partial pages
    (8, 1, 40, 16, [2048]),                                   # MQA, one long context: split into parts
    (4, 4, 16, 3, [1, 2, 3, 700]),                             # no grouping, mixed lengths with splits
    (7, 7, 8, 16, [1]),
    (8, 2, 128, 16, [1, 17, 200, 1000]),                      # head_dim 128 (its own compiled loop)
    # the AVX-512 path's edges: 16-row score tiles and 256-row softmax chunks (contexts one short of,
    # at and one past them), runtime head_dims with masked tails (odd; 32-wide bf16 steps; column
    # blocks of 64), query groups of 1, 2, 5 and 8 (blocks of up to 4 heads in P.V)
    (16, 2, 128, 16, [1, 31, 255, 256, 257, 511, 1500]),      # group 8, head_dim 128
    (5, 1, 33, 7, [1, 16, 17, 255, 256, 300]),                # group 5, odd head_dim, block 7
    (6, 3, 96, 16, [3, 100, 513]),                            # group 2, three 32-wide steps
    (10, 2, 80, 4, [47, 129]),                                # group 5, head_dim 80 (five 16-wide chunks)
    (3, 3, 17, 2, [1, 9, 40]),                                # group 1, odd head_dim, block 2
])
def test_paged_decode_attention_equals_float64(dtype, nh, nkv, hd, block, context_lens):
    g = torch.Generator().manual_seed(len(context_lens) * nh + hd)
    layers, layer = 3, 1
    pages = sum(-(-n // block) for n in context_lens) + 3
    kv = make_pool(g, pages, layers, block, nkv * hd, dtype)
    tables, contexts = fill_contexts(g, kv, layer, context_lens, dtype)
    n = len(context_lens)
    # q as the model passes it: a strided view into the rows of a wider qkv buffer
    qkv = torch.randn(n, (nh + 2 * nkv) * hd, generator=g).to(dtype)
    q = qkv[:, :nh * hd].view(n, nh, hd)
    scale = hd ** -0.5
    expected = reference_decode(q.double(), contexts, nkv, scale)
    # the thread count decides how the work splits: a row's KV heads in one item, or one KV head
    # per item, contexts in parts or whole
    for _ in at_thread_counts((1, 2, 3)):
        out = torch.empty(n, nh, hd, dtype=dtype)
        cpu_kernels.paged_decode_attention(out, q, kv[:, 0, layer], kv[:, 1, layer], tables,
                                           torch.tensor(context_lens), scale)
        assert not out.isnan().any(), "read a slot past a sequence's context"
        torch.testing.assert_close(out.double(), expected, rtol=0.0, atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 1, 5, 16, 100, 300, 5000])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_paged_decode_attention_window_and_softcap_equal_float64(dtype, window, softcap):
    """Sliding windows shorter than, equal to and longer than the contexts (1 row; a page; past the
    AVX-512 path's 256-row chunks; longer than all), with and without Gemma 2's soft cap (scores large
    enough that it bites), at 1..3 threads (contexts whole or split into parts); rows before a window
    are NaN in the pool: reading one would show."""
    g = torch.Generator().manual_seed(17 + (window or 0))
    nh, nkv, hd, block, lens = 8, 2, 64, 16, [1, 5, 16, 17, 100, 299, 700]
    kv = make_pool(g, sum(-(-n // block) for n in lens) + 2, 2, block, nkv * hd, dtype)
    tables, contexts = fill_contexts(g, kv, 1, lens, dtype)
    if window is not None:      # rows before each window: NaN, never to be read
        for i, n in enumerate(lens):
            for t in range(max(0, n - window)):
                kv[tables[i, t // block], :, 1, t % block] = float("nan")
    q = (torch.randn(len(lens), nh, hd, generator=g) * 3).to(dtype)
    scale = 0.2
    expected = reference_decode(q.double(), contexts, nkv, scale, window, softcap)
    for _ in at_thread_counts((1, 2, 3)):
        out = torch.empty_like(q)
        cpu_kernels.paged_decode_attention(out, q, kv[:, 0, 1], kv[:, 1, 1], tables, torch.tensor(lens), scale,
                                           window, softcap)
        assert not out.isnan().any(), "read a row outside a window"
        torch.testing.assert_close(out.double(), expected, rtol=0.0, atol=ATOL[dtype])


def test_paged_decode_attention_many_sequences_and_thread_counts():
    """16 decodes of random lengths up to 2,048 (the engine's batch), 1 and 2 threads: each thread
    count partitions the work differently, the result must not change beyond rounding."""
    g = torch.Generator().manual_seed(7)
    nh, nkv, hd, block = 9, 3, 64, 16
    lens = [int(x) for x in torch.randint(1, 2049, (16,), generator=g)]
    kv = make_pool(g, sum(-(-n // block) for n in lens) + 1, 2, block, nkv * hd, torch.bfloat16)
    tables, contexts = fill_contexts(g, kv, 0, lens, torch.bfloat16)
    q = torch.randn(16, nh, hd, generator=g).bfloat16()
    expected = reference_decode(q.double(), contexts, nkv, hd ** -0.5)
    for _ in at_thread_counts():
        out = torch.empty_like(q)
        cpu_kernels.paged_decode_attention(out, q, kv[:, 0, 0], kv[:, 1, 0], tables, torch.tensor(lens), hd ** -0.5)
        torch.testing.assert_close(out.double(), expected, rtol=0.0, atol=ATOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_decode_attention_nan_stays_in_its_group(dtype):
    """A NaN in one sequence's cached K (inside its context) or in one query head gives NaN for that
    KV head's group or that head only; every other output stays finite, whatever the split."""
    g = torch.Generator().manual_seed(11)
    nh, nkv, hd, block, lens = 9, 3, 64, 16, [40, 300, 17, 2048]
    kv = make_pool(g, sum(-(-n // block) for n in lens) + 3, 1, block, nkv * hd, dtype)
    tables, _ = fill_contexts(g, kv, 0, lens, dtype)
    q = torch.randn(len(lens), nh, hd, generator=g).to(dtype)
    q[1, 4, 7] = float("nan")
    kv[tables[0, 1], 0, 0, 3, 5] = float("nan")          # sequence 0, row 19, KV head 0
    expected = torch.zeros(len(lens), nh, dtype=torch.bool)
    expected[0, :3] = expected[1, 4] = True
    for _ in at_thread_counts((1, 4)):
        out = torch.empty_like(q)
        cpu_kernels.paged_decode_attention(out, q, kv[:, 0, 0], kv[:, 1, 0], tables, torch.tensor(lens), hd ** -0.5)
        assert torch.equal(out.isnan().any(-1), expected)
        assert out[~expected].isfinite().all()


def test_paged_decode_attention_rejects_bad_tables():
    kv = torch.zeros(4, 2, 1, 8, 16)
    q, out = torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.paged_decode_attention(out, q, kv[:, 0, 0], kv[:, 1, 0], torch.tensor([[9]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="does not fit the block table"):
        cpu_kernels.paged_decode_attention(out, q, kv[:, 0, 0], kv[:, 1, 0], torch.tensor([[1]]), torch.tensor([9]), 1.0)


# ---- paged prefill attention ---------------------------------------------------------------------

def reference_prefill(q, first_pos, k, v, nkv, scale, window=None, softcap=None):
    """One chunk: q [n, nh, hd] float64 at positions first_pos.., k, v [first_pos + n, nkv * hd] its
    sequence's keys and values (the chunk's own last). Causal, within the window if given. Returns
    [n, nh, hd]."""
    n, nh, hd = q.shape
    group = nh // nkv
    k, v = k.view(-1, nkv, hd), v.view(-1, nkv, hd)
    keys, rows = torch.arange(k.shape[0])[None, :], torch.arange(first_pos, first_pos + n)[:, None]
    hidden = keys > rows                                                                            # [n, ctx]
    if window is not None:
        hidden |= keys <= rows - window
    out = torch.empty(n, nh, hd, dtype=torch.float64)
    for h in range(nh):
        scores = capped(q[:, h] @ k[:, h // group].T * scale, softcap).masked_fill(hidden, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


def run_prefill(g, dtype, nh, nkv, hd, block, chunks, decodes=0, window=None, softcap=None):
    """chunks: (first_pos, rows) per chunk, all in one call after `decodes` rows the kernel must leave
    alone (as a mixed step's decodes). Returns the kernel's output [T, nh, hd] and the float64
    reference of the chunks' rows. window: keys before every row's window are NaN in the pool."""
    layers, layer = 2, 1
    lens = [first + rows for first, rows in chunks]
    kv = make_pool(g, sum(-(-n // block) for n in lens) + 2, layers, block, nkv * hd, dtype)
    tables, contexts = fill_contexts(g, kv, layer, lens, dtype)
    if window is not None:
        for i, (first, _) in enumerate(chunks):
            for t in range(max(0, first - window + 1)):
                kv[tables[i, t // block], :, layer, t % block] = float("nan")
    T = decodes + sum(rows for _, rows in chunks)
    # q as the model passes it: a strided view into the rows of a wider qkv buffer
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, generator=g).to(dtype)
    q = qkv[:, :nh * hd].view(T, nh, hd)
    if softcap is not None:     # scores large enough that the cap bites
        q.mul_(3)
    out = torch.full((T, nh, hd), 5.0, dtype=dtype)
    starts = torch.tensor([decodes] + [rows for _, rows in chunks]).cumsum(0)
    scale = hd ** -0.5
    cpu_kernels.paged_prefill_attention(out, q, kv[:, 0, layer], kv[:, 1, layer], tables, starts,
                                        torch.tensor([first for first, _ in chunks]), scale, window, softcap)
    expected = torch.cat([reference_prefill(q[a:b].double(), first, k, v, nkv, scale, window, softcap)
                          for (first, _), (k, v), a, b in zip(chunks, contexts, starts[:-1], starts[1:])])
    assert torch.equal(out[:decodes], torch.full_like(out[:decodes], 5.0)), "wrote rows outside the chunks"
    return out[decodes:], expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nh, nkv, hd, block, chunks", [
    (9, 3, 64, 16, [(0, 64), (240, 240), (480, 32)]),         # SmolLM2's heads: W1's first chunk, a 512-token
                                                               # prompt's second and third (GQA 3)
    (8, 2, 128, 16, [(0, 1), (17, 300), (1748, 300)]),        # GQA 4, head_dim 128, a context of 2,048
    (6, 6, 24, 5, [(0, 7), (3, 1), (11, 13), (49, 2)]),       # no grouping, odd block: partial pages everywhere
    (12, 4, 40, 3, [(1, 1), (0, 300), (100, 17)]),            # GQA 3, head_dim not a multiple of 16
    (4, 1, 10, 16, [(2047, 1), (5, 33)]),                     # MQA, tiny heads, one row at position 2,047
])
def test_paged_prefill_attention_equals_float64(dtype, nh, nkv, hd, block, chunks):
    g = torch.Generator().manual_seed(nh * hd + len(chunks))
    out, expected = run_prefill(g, dtype, nh, nkv, hd, block, chunks, decodes=3)
    assert not out.isnan().any(), "read a slot past a chunk's context"
    torch.testing.assert_close(out.double(), expected, rtol=0.0, atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [1, 3, 8, 16, 33, 100, 4096])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_paged_prefill_attention_window_and_softcap_equal_float64(dtype, window, softcap):
    """Sliding windows from 1 row to past every context, chunks from position 0 and chunks after
    cached rows whose windows start inside them, cross them or lie wholly in the cache (a chunked
    prefill crossing the window), rows of one 16-row item whose windows start apart; with and
    without the soft cap; 1 and 2 threads. Keys before the first row's window are NaN in the pool."""
    chunks = [(0, 40), (5, 3), (20, 37), (100, 16), (250, 1), (61, 90)]
    for _ in at_thread_counts():
        out, expected = run_prefill(torch.Generator().manual_seed(window), dtype, 6, 2, 32, 16, chunks, decodes=2,
                                    window=window, softcap=softcap)
        assert not out.isnan().any(), "read a key before a window"
        torch.testing.assert_close(out.double(), expected, rtol=0.0, atol=ATOL[dtype])


def test_paged_prefill_attention_random_chunks_and_thread_counts():
    """Random chunks of 1..300 rows over contexts up to 2,048, several per call, 1 and 2 threads (which
    split the work differently): the result must not change beyond rounding."""
    rng = random.Random(3)
    chunks = [(rng.randint(0, 1748), rng.randint(1, 300)) for _ in range(5)]
    for _ in at_thread_counts():
        out, expected = run_prefill(torch.Generator().manual_seed(4), torch.bfloat16, 9, 3, 64, 16, chunks)
        torch.testing.assert_close(out.double(), expected, rtol=0.0, atol=ATOL[torch.bfloat16])


def test_paged_prefill_attention_rejects_bad_tables():
    kv = torch.zeros(4, 2, 1, 8, 16)
    q, out = torch.zeros(3, 2, 8), torch.zeros(3, 2, 8)
    starts = torch.tensor([0, 3])
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.paged_prefill_attention(out, q, kv[:, 0, 0], kv[:, 1, 0], torch.tensor([[9]]), starts,
                                            torch.tensor([2]), 1.0)
    with pytest.raises(RuntimeError, match="does not fit the block table"):
        cpu_kernels.paged_prefill_attention(out, q, kv[:, 0, 0], kv[:, 1, 0], torch.tensor([[1]]), starts,
                                            torch.tensor([6]), 1.0)
    with pytest.raises(RuntimeError, match="query rows outside q"):
        cpu_kernels.paged_prefill_attention(out, q, kv[:, 0, 0], kv[:, 1, 0], torch.tensor([[1]]), torch.tensor([0, 4]),
                                            torch.tensor([0]), 1.0)
    odd = torch.zeros(3, 2, 7)                      # head_dim 7: bf16 runs as pairs of dimensions
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        cpu_kernels.paged_prefill_attention(odd, odd, kv[:, 0, 0, :, :14], kv[:, 1, 0, :, :14], torch.tensor([[1]]),
                                            starts, torch.tensor([0]), 1.0)


# ---- residual add + RMSNorm ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (5, 67), (33, 576), (300, 96)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_equals_float64(dtype, rows, hidden, with_delta):
    g = torch.Generator().manual_seed(rows + hidden)
    h = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype) if with_delta else None
    weight = torch.randn(hidden, generator=g).to(dtype)
    eps = 1e-5
    summed = (h.float() + delta.float()).to(dtype) if with_delta else h.clone()   # eager's rounding of h + delta
    out = cpu_kernels.add_rms_norm(h, delta, weight, eps)
    assert torch.equal(h, summed), "h must hold h + delta rounded to its dtype"
    x = summed.double()
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    scale = expected.abs().amax()
    torch.testing.assert_close(out.double() / scale, expected / scale, rtol=0.0, atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (5, 67), (33, 2304)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_unit_offset_rms_norm_equals_transformers_gemma(dtype, rows, hidden, with_delta):
    """Gemma's norm: the weight stored as w, applied as (1 + w) in float32 (build_weights passes the
    float32 1 + w), the product rounded once: transformers' Gemma2RMSNorm within that one rounding,
    and float64 within the dtype's tolerance. The sandwich norms are this without a delta."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    g = torch.Generator().manual_seed(rows * hidden)
    h = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype) if with_delta else None
    norm = Gemma2RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g) * 0.5)
    summed = (h.float() + delta.float()).to(dtype) if with_delta else h.clone()
    out = cpu_kernels.add_rms_norm(h, delta, norm.weight.detach().float() + 1.0, 1e-6)
    assert out.dtype == dtype and torch.equal(h, summed)
    with torch.no_grad():
        theirs = norm(summed)
    torch.testing.assert_close(out, theirs, rtol=2 ** -7 if dtype == torch.bfloat16 else 2e-6, atol=1e-6)
    x = summed.double()
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + norm.weight.detach().double())
    scale = expected.abs().amax()
    torch.testing.assert_close(out.double() / scale, expected / scale, rtol=0.0, atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_head_rms_norm_equals_eager_per_head(dtype, unit_offset):
    """Qwen3's and Gemma 3's q/k norms: every q head of a strided qkv [T, (nh + 2 nkv) hd] normed with
    the q weight and every k head with the k weight, in place, v untouched, as the eager path's
    _rms_norm over [T, heads, hd] (bf16 weights: the same rounding steps; Gemma 3's float32 (1 + w):
    within one rounding)."""
    from asyncserve.model.llama import _rms_norm
    g = torch.Generator().manual_seed(3)
    for tokens, nh, nkv, hd in [(1, 4, 2, 32), (7, 16, 8, 128), (40, 3, 1, 10)]:
        buffer = (torch.randn(tokens, (nh + 2 * nkv) * hd + 4, generator=g) * 2).to(dtype)
        qkv = buffer[:, :(nh + 2 * nkv) * hd]
        before, tail = qkv.clone(), buffer[:, -4:].clone()
        weights = [torch.randn(hd, generator=g) for _ in range(2)]
        q_w, k_w = [w.float() + 1.0 if unit_offset else w.to(dtype) for w in weights]
        for _ in at_thread_counts():
            qkv.copy_(before)
            cpu_kernels.head_rms_norm(qkv, q_w, k_w, nh, nkv, 1e-6)
            q_ref = _rms_norm(before[:, :nh * hd].view(tokens, nh, hd), q_w, 1e-6).view(tokens, -1)
            k_ref = _rms_norm(before[:, nh * hd:(nh + nkv) * hd].view(tokens, nkv, hd), k_w, 1e-6).view(tokens, -1)
            rtol = 2 ** -7 if dtype == torch.bfloat16 else 2e-6
            torch.testing.assert_close(qkv[:, :nh * hd], q_ref, rtol=rtol, atol=1e-5)
            torch.testing.assert_close(qkv[:, nh * hd:(nh + nkv) * hd], k_ref, rtol=rtol, atol=1e-5)
            assert torch.equal(qkv[:, (nh + nkv) * hd:], before[:, (nh + nkv) * hd:]), "v must stay as it was"
            assert torch.equal(buffer[:, -4:], tail)


def test_norm_weights_of_another_dtype_are_refused():
    h = torch.randn(2, 8).bfloat16()
    for weight in (torch.ones(8, dtype=torch.float16), torch.ones(8, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="expected BFloat16 or float32"):
            cpu_kernels.add_rms_norm(h, None, weight, 1e-6)
        with pytest.raises(RuntimeError, match="expected BFloat16 or float32"):
            cpu_kernels.head_rms_norm(torch.randn(2, 4 * 2).bfloat16(), weight[:2], weight[:2], 2, 1, 1e-6)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_kernels.head_rms_norm(torch.randn(2, 8), torch.ones(2), torch.ones(2).bfloat16(), 2, 1, 1e-6)


# ---- RoPE + KV write -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, nh, nkv, hd, rot", [(1, 4, 2, 16, 16), (7, 9, 3, 64, 64), (40, 5, 1, 10, 10),
                                                     (7, 4, 2, 32, 24), (3, 3, 1, 16, 2)])
def test_rope_write_kv_equals_float64(dtype, tokens, nh, nkv, hd, rot):
    """rot < hd: partial RoPE (Phi-4-mini), the tables [max_pos, rot], each head's other dimensions kept."""
    g = torch.Generator().manual_seed(tokens * nh)
    layers, block, pages, max_pos = 3, 4, 32, 300
    kv_size = nkv * hd
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    # a wider buffer: the kernel must follow qkv's row stride
    buffer = torch.randn(tokens, (nh + 2 * nkv) * hd + 5, generator=g).to(dtype)
    qkv = buffer[:, :(nh + 2 * nkv) * hd]
    before, buffer_before = qkv.clone(), buffer.clone()
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    positions[0] = max_pos - 1
    kv = torch.full((pages, 2, layers, block, kv_size), 7.0, dtype=dtype)
    kv_rows = kv.view(-1, kv_size)
    row_stride = 2 * layers * block                 # rows per page
    slots = torch.randperm(pages * block, generator=g)[:tokens]
    write_rows = (slots // block) * row_stride + slots % block
    layer = 2
    cpu_kernels.rope_write_kv(qkv, positions, cos, sin, kv_rows, write_rows, layer * block,
                              (layers + layer) * block, nh, nkv)

    x = before[:, :(nh + nkv) * hd].double().view(tokens, nh + nkv, hd)
    c, s = cos[positions].double()[:, None], sin[positions].double()[:, None]
    part = x[..., :rot]
    rotated = torch.cat([-part[..., rot // 2:], part[..., :rot // 2]], dim=-1)
    expected = torch.cat([part * c + rotated * s, x[..., rot:]], dim=-1).view(tokens, -1)
    got = qkv[:, :(nh + nkv) * hd].double()
    torch.testing.assert_close(got, expected, rtol=0.0, atol=ATOL[dtype] * 4)
    assert torch.equal(qkv[:, (nh + nkv) * hd:], before[:, (nh + nkv) * hd:]), "v must stay as it was"
    assert torch.equal(buffer[:, (nh + 2 * nkv) * hd:], buffer_before[:, (nh + 2 * nkv) * hd:])

    want = torch.full_like(kv, 7.0)
    for t in range(tokens):
        page, slot = int(slots[t]) // block, int(slots[t]) % block
        want[page, 0, layer, slot] = qkv[t, nh * hd:(nh + nkv) * hd]
        want[page, 1, layer, slot] = qkv[t, (nh + nkv) * hd:]
    assert torch.equal(kv, want), "K and V must land in their slots of the layer, and nothing else change"


def test_rope_write_kv_rejects_rows_outside_the_pool_and_bad_tables():
    qkv, table = torch.zeros(1, 4 * 8), torch.zeros(16, 8)
    kv_rows = torch.zeros(10, 8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.rope_write_kv(qkv, torch.tensor([0]), table, table, kv_rows, torch.tensor([9]), 0, 4, 2, 1)
    for bad in (torch.zeros(16, 10), torch.zeros(16, 5)):       # wider than a head, odd
        with pytest.raises(RuntimeError, match=r"\[max_pos, rot\]"):
            cpu_kernels.rope_write_kv(qkv, torch.tensor([0]), bad, bad, kv_rows, torch.tensor([0]), 0, 4, 2, 1)


# ---- LoRA of a step's segments -------------------------------------------------------------------

def make_adapter_pool(g, ranks, fan_in, fan_outs, layers, dtype):
    """Adapters' A and B^T rows scattered over a flat pool (shuffled slots, NaN between them: a kernel
    reading a wrong offset returns NaN), and the step tables pointing at them. ranks: [n][P] (0: not
    targeted). Returns flat, (ranks, a_ptr, b_ptr, scaling) as LoraBatch.tables() has them, and each
    adapter's float64 (A [L, P] of [r, in], B^T [L, P] of [r, out])."""
    n, P = len(ranks), len(fan_outs)
    r_max = max(1, max(max(r) for r in ranks))
    width = max(fan_in, *fan_outs)
    rows = [(i, l, p, j, kind) for i in range(n) for l in range(layers) for p in range(P)
            for j in range(ranks[i][p]) for kind in (0, 1)]
    slots = torch.randperm(len(rows) + 3, generator=g).tolist()
    flat = torch.full(((len(rows) + 3) * width,), float("nan"), dtype=dtype)
    a_ptr = torch.zeros(n, layers, P, r_max, dtype=torch.int64)
    b_ptr = torch.zeros(n, layers, P, r_max, dtype=torch.int64)
    weights = [[[None] * P for _ in range(layers)] for _ in range(n)]
    for slot, (i, l, p, j, kind) in zip(slots, rows):
        size = fan_in if kind == 0 else fan_outs[p]
        values = (torch.randn(size, generator=g) / size ** 0.5).to(dtype)
        flat[slot * width:slot * width + size] = values
        (a_ptr if kind == 0 else b_ptr)[i, l, p, j] = slot * width
    for i in range(n):
        for l in range(layers):
            for p in range(P):
                r = ranks[i][p]
                a = torch.stack([flat[o:o + fan_in] for o in a_ptr[i, l, p, :r].tolist()]) if r else None
                b = torch.stack([flat[o:o + fan_outs[p]] for o in b_ptr[i, l, p, :r].tolist()]) if r else None
                weights[i][l][p] = (a.double(), b.double()) if r else None
    scaling = torch.rand(n, layers, P, generator=g) * 4
    return flat, (torch.tensor(ranks, dtype=torch.int32), a_ptr, b_ptr, scaling), weights


def reference_lora(x, y, runs, tables, weights, layer, projections):
    """float64: y + for each run and targeted projection scaling * (x[run] @ A^T) @ B at its columns."""
    scaling = tables[3].double()
    out = y.double().clone()
    for begin, end, i in runs:
        for p, col, fan_out in projections:
            if weights[i][layer][p] is not None:
                a, b = weights[i][layer][p]
                out[begin:end, col:col + fan_out] += scaling[i, layer, p] * (x[begin:end].double() @ a.t()) @ b
    return out


def lora_case(dtype, fan_in, fan_outs, ranks, segments, seed):
    """segments: [(tokens, adapter or -1)], neighbours of one adapter merged into runs as the backend does."""
    g = torch.Generator().manual_seed(seed)
    layers, layer = 3, 1
    flat, tables, weights = make_adapter_pool(g, ranks, fan_in, fan_outs, layers, dtype)
    runs, start = [], 0
    for tokens, adapter in segments:
        if adapter >= 0 and runs and runs[-1][1] == start and runs[-1][2] == adapter:
            runs[-1][1] += tokens
        elif adapter >= 0:
            runs.append([start, start + tokens, adapter])
        start += tokens
    out_total = sum(fan_outs)
    # x and y as the model passes them: views into wider buffers (row strides beyond their widths)
    x = torch.randn(start, fan_in + 3, generator=g).to(dtype)[:, :fan_in]
    y = torch.randn(start, out_total + 5, generator=g).to(dtype)[:, :out_total]
    columns = [sum(fan_outs[:p]) for p in range(len(fan_outs))]
    projections = [(p, col, fo) for p, (col, fo) in enumerate(zip(columns, fan_outs))]
    return x, y, flat, runs, tables, weights, layer, projections


def run_lora(x, y, flat, runs, tables, layer, projections):
    cpu_kernels.lora_segments(y, x, flat, torch.tensor(runs, dtype=torch.int64).view(-1, 3), *tables, layer,
                              torch.tensor(projections, dtype=torch.int64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fan_in, fan_outs, ranks, segments", [
    # W1's q, k, v at SmolLM2's sizes: four adapters of ranks 8/16 interleaved, one token per segment
    (576, [576, 192, 192], [[8] * 3, [16] * 3, [8] * 3, [16] * 3],
     [(1, 0), (1, 0), (1, 1), (1, 2), (1, 1), (1, 3), (1, -1), (1, 3), (1, 0)]),
    # odd widths (no multiple of 32 or 16), ranks 1..64, untargeted projections, base-model segments
    (37, [29, 70, 5], [[1, 0, 3], [64, 64, 64], [0, 7, 0], [33, 2, 17]],
     [(3, 2), (1, -1), (17, 1), (2, 0), (9, 3), (4, -1), (1, 1), (30, 2)]),
    # long prefill runs (tiles of 8 and a remainder) beside decodes of another adapter
    (96, [160], [[16], [5]], [(1, 1), (1, 1), (45, 0), (13, 1), (1, 0)]),
    # one token, one rank-1 projection
    (1, [1], [[1]], [(1, 0)]),
])
def test_lora_segments_equals_float64(dtype, fan_in, fan_outs, ranks, segments):
    x, y, flat, runs, tables, weights, layer, projections = lora_case(dtype, fan_in, fan_outs, ranks, segments,
                                                                       seed=fan_in + len(segments))
    before = y.clone()
    expected = reference_lora(x, before, runs, tables, weights, layer, projections)
    run_lora(x, y, flat, runs, tables, layer, projections)
    assert not y.isnan().any(), "read a pool element outside the adapter's rows"
    untouched = torch.ones(y.shape[0], dtype=torch.bool)
    for begin, end, _ in runs:
        untouched[begin:end] = False
    assert torch.equal(y[untouched], before[untouched]), "tokens without LoRA must stay as they were"
    scale = expected.abs().amax()
    torch.testing.assert_close(y.double() / scale, expected / scale, rtol=0.0, atol=ATOL[dtype])


def test_lora_segments_thread_counts_and_many_adapters():
    """16 adapters of ranks 1..64, each one decode and a few prefill runs (the Punica 'distinct' mix),
    with 1 and 2 threads: the threads split the items differently, the result must not change."""
    g = torch.Generator().manual_seed(3)
    ranks = [[int(r)] * 2 for r in torch.randint(1, 65, (16,), generator=g)]
    segments = [(1, i) for i in range(16)] + [(int(torch.randint(1, 40, (1,), generator=g)), i) for i in (3, 9, 12)]
    x, y, flat, runs, tables, weights, layer, projections = lora_case(torch.bfloat16, 576, [576, 1536], ranks,
                                                                       segments, seed=4)
    expected = reference_lora(x, y, runs, tables, weights, layer, projections)
    for _ in at_thread_counts():
        out = y.clone()
        run_lora(x, out, flat, runs, tables, layer, projections)
        scale = expected.abs().amax()
        torch.testing.assert_close(out.double() / scale, expected / scale, rtol=0.0, atol=ATOL[torch.bfloat16])


def test_lora_segments_rejects_rows_outside_the_pool():
    x, y, flat, runs, tables, weights, layer, projections = lora_case(torch.float32, 8, [8], [[2]], [(2, 0)], seed=1)
    ranks, a_ptr, b_ptr, scaling = tables
    bad = a_ptr.clone()
    bad[0, layer, 0, 1] = flat.numel() - 4
    with pytest.raises(RuntimeError, match="outside the pool"):
        run_lora(x, y, flat, runs, (ranks, bad, b_ptr, scaling), layer, projections)
    with pytest.raises(RuntimeError, match="outside the tables"):
        run_lora(x, y, flat, [[0, 2, 1]], tables, layer, projections)
    with pytest.raises(RuntimeError, match="inside x"):
        run_lora(x, y, flat, [[0, 3, 0]], tables, layer, projections)


def expected_lines(flat, runs, tables, layer, projections, fan_in):
    """The 64-byte lines (offsets from flat's first element) of the rows lora_segments reads."""
    ranks, a_ptr, b_ptr, _ = tables
    base, size = flat.data_ptr(), flat.element_size()
    lines = set()
    for adapter in {run[2] for run in runs}:
        for p, _, fan_out in projections:
            for j in range(int(ranks[adapter, p])):
                for offset, width in ((a_ptr[adapter, layer, p, j], fan_in), (b_ptr[adapter, layer, p, j], fan_out)):
                    start = base + int(offset) * size
                    lines.update(line - base for line in range(start // 64 * 64, start + width * size, 64))
    return lines


@pytest.mark.parametrize("layout", ["scattered", "packed", "odd widths"])
def test_lora_prefetch_lines_are_the_rows_lora_segments_reads(layout):
    """What the native decoder's GEMM asks for ahead of a LoRA call (lora.h's lora_spans, split between
    threads by gemm.h's SideStream): the lines of exactly the rows that lora_segments reads, each
    run's adapter once however many runs it has, rows of other layers, adapters and untargeted
    projections left out; rows scattered over the pool, packed end to end as the pager lays them
    out (merged into long spans), or of odd widths (lines shared by neighbouring rows). The threads'
    shares split the one-thread order into contiguous pieces of near-equal size."""
    if layout == "odd widths":
        fan_in, fan_outs, ranks = 37, [29, 70, 5], [[1, 0, 3], [64, 64, 64], [0, 7, 0], [33, 2, 17]]
    else:
        fan_in, fan_outs, ranks = 576, [576, 192, 192], [[8] * 3, [16] * 3, [0, 8, 8], [16] * 3]
    segments = [(1, 0), (1, 2), (3, -1), (1, 0), (9, 2), (1, 3), (2, 0)]    # adapter 1 not in the step
    x, y, flat, runs, tables, weights, layer, projections = lora_case(torch.bfloat16, fan_in, fan_outs, ranks,
                                                                       segments, seed=5)
    if layout == "packed":   # each adapter's rows in order: (layer, projection, A rows then B^T rows)
        r_ranks, a_ptr, b_ptr, scaling = tables
        a_ptr, b_ptr, offset = a_ptr.clone(), b_ptr.clone(), 0
        for i in range(len(ranks)):
            for l in range(a_ptr.shape[1]):
                for p, fan_out in enumerate(fan_outs):
                    r = ranks[i][p]
                    a_ptr[i, l, p, :r] = offset + torch.arange(r) * fan_in
                    b_ptr[i, l, p, :r] = offset + r * fan_in + torch.arange(r) * fan_out
                    offset += r * (fan_in + fan_out)
        tables = (r_ranks, a_ptr, b_ptr, scaling)
        flat = torch.randn(offset).to(torch.bfloat16)
    expected = expected_lines(flat, runs, tables, layer, projections, fan_in)
    args = (y, x, flat, torch.tensor(runs, dtype=torch.int64).view(-1, 3), *tables, layer,
            torch.tensor(projections, dtype=torch.int64))
    (whole,) = cpu_kernels.lora_prefetch_lines(*args, 1)
    assert set(whole.tolist()) == expected
    if layout != "odd widths":
        assert len(whole) == len(expected), "a line asked for twice"
    for parts in (2, 3, 7):
        shares = cpu_kernels.lora_prefetch_lines(*args, parts)
        assert torch.equal(torch.cat(shares), whole)
        assert [len(s) for s in shares] == [len(whole) * (k + 1) // parts - len(whole) * k // parts
                                            for k in range(parts)]


# ---- the engine ----------------------------------------------------------------------------------

def test_engine_native_equals_eager_and_transformers(tiny_model, monkeypatch):
    """float32, all adapters (ranks 1..64) and the base in one generate call with prefill chunks beside
    decodes: the native kernels (decode attention, norm, RoPE, the LoRA backend's lora_segments) give
    the eager path's greedy tokens, and both match transformers+PEFT. The layer loop in Python, whose
    kernel calls this counts (the native loop runs the same: see the decoder loop's test below)."""
    from peft import PeftModel

    monkeypatch.setenv("ASYNCSERVE_NATIVE_DECODER", "0")
    root, tok, base, paths = tiny_model.root, tiny_model.tokenizer, tiny_model.base, tiny_model.adapters
    rng = random.Random(5)
    words = "the fox jumps over lazy dog adapters serve many models batch token step rank".split()
    prompts = [tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))) for _ in range(3)]
    cases = [(ids, adapter) for ids in prompts for adapter in [None, *ADAPTERS]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    adapters = {k: str(v) for k, v in paths.items()}

    calls = {"paged_decode_attention": 0, "lora_segments": 0}
    for name in calls:
        record_calls(monkeypatch, cpu_kernels, name, lambda *a, _name=name: calls.__setitem__(_name, calls[_name] + 1))
    runs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("ASYNCSERVE_NATIVE", mode)
        llm = LLM(model=str(root), adapters=adapters, dtype="float32", device="cpu", max_step_tokens=24)
        runs[mode] = [o.token_ids for o in llm.generate([c[0] for c in cases], params, adapters=[c[1] for c in cases])]
        if mode == "1":
            assert all(calls.values()), f"the engine did not run every native kernel: {calls}"
            used = dict(calls)
    assert calls == used, "ASYNCSERVE_NATIVE=0 must keep the model and the LoRA backend on the eager path"
    assert runs["1"] == runs["0"]

    exact = 0
    for i, (ids, adapter) in enumerate(cases):
        model = base if adapter is None else PeftModel.from_pretrained(base, paths[adapter]).eval()
        ref = reference_greedy(model, ids, params.max_tokens)
        if adapter is not None:
            model.unload()
        exact += assert_greedy_matches(runs["1"][i], ref, tie_tol=1e-3, label=f"case {i} adapter {adapter}")
    assert exact >= len(cases) - 1



def test_engine_native_prefill_over_cached_pages_equals_eager(tiny_model, monkeypatch):
    """float32, prompts of 40-90 tokens chunked under a 24-token budget beside decodes, and a shared
    40-token prefix that later prompts take from the prefix cache: the native prefill attention
    (which then attends to cached pages) gives the eager path's greedy tokens. The layer loop in Python,
    whose kernel calls this records."""
    monkeypatch.setenv("ASYNCSERVE_NATIVE_DECODER", "0")
    root, tok, paths = tiny_model.root, tiny_model.tokenizer, tiny_model.adapters
    rng = random.Random(9)
    prefix = [rng.randrange(3, len(tok)) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, len(tok)) for _ in range(rng.randint(1, 50))] for _ in range(4)]
    names = [None, "r8_attn_rs", None, "r64_all"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first_positions = []
    record_calls(monkeypatch, cpu_kernels, "paged_prefill_attention", lambda *a: first_positions.extend(a[6].tolist()))
    runs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("ASYNCSERVE_NATIVE", mode)
        llm = LLM(model=str(root), adapters={k: str(v) for k, v in paths.items()}, dtype="float32", device="cpu",
                  max_step_tokens=24)
        # the base prompt alone first: its blocks are then cached for prompts 2 (base) and, per adapter, not for 1, 3
        tokens = [llm.generate([prompts[0]], params)[0].token_ids]
        tokens += [o.token_ids for o in llm.generate(prompts[1:], params, adapters=names[1:])]
        runs[mode] = tokens
        assert llm.engine.load_snapshot().prefix_hit_tokens >= 32, "prompt 2 should take the cached prefix"
        if mode == "1":
            assert any(p > 0 for p in first_positions), "no native prefill chunk attended to cached pages"
            used = len(first_positions)
    assert len(first_positions) == used, "ASYNCSERVE_NATIVE=0 must keep the model on the eager path"
    assert runs["1"] == runs["0"]


def test_native_decoder_loop_gives_the_python_loops_logits(tiny_model, monkeypatch):
    """bf16 (weights packed for gemm.h where the CPU has AVX512-BF16, else as torch's F.linear takes
    them): the layer loop in one native call (kernels/cpu/decoder.h) runs the Python loop's kernels in
    its order, so every step's logits are the same bits: greedy tokens and the top-5 logprobs of each,
    for the base and all adapters (every projection, ranks 1..64) in one batch, prompts chunked beside
    decodes, one taking a cached prefix; then in dLoRA's merged mode, whose swapped weights the loop
    must pick up."""
    from asyncserve.model import llama

    root, tok, paths = tiny_model.root, tiny_model.tokenizer, tiny_model.adapters
    rng = random.Random(11)
    prefix = [rng.randrange(3, len(tok)) for _ in range(20)]
    prompts = [prefix + [rng.randrange(3, len(tok)) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    names = [None, *ADAPTERS]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    native_steps = []
    record_calls(monkeypatch, llama, "_forward_native", lambda *a: native_steps.append(a[4].num_decode))
    runs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("ASYNCSERVE_NATIVE_DECODER", mode)
        llm = LLM(model=str(root), adapters={k: str(v) for k, v in paths.items()}, dtype="bfloat16", device="cpu",
                  max_step_tokens=24)
        outs = llm.generate([prompts[0]], params) + llm.generate(prompts, params, adapters=names)
        runs[mode] = [(o.token_ids, o.logprobs, o.top_logprobs) for o in outs]
        # merged every other step: the loop must run the merged weights, then the base ones again
        engine = llm.engine
        seqs = run_merged(engine, [(ids, "r64_all") for ids in prompts[:2]],
                          lambda plan, step: "r64_all" if step % 2 == 0 else None, params)
        assert engine.merge_stats().switches >= 2
        runs[mode] += [(seq.output_ids, seq.logprobs, seq.top_logprobs) for seq in seqs]
        if mode == "1":
            assert any(n == 0 for n in native_steps) and any(n > 0 for n in native_steps), native_steps
            used = len(native_steps)
    assert len(native_steps) == used, "ASYNCSERVE_NATIVE_DECODER=0 must run the Python loop"
    assert runs["1"] == runs["0"]


# ---- bf16 GEMM over packed weights (kernels/cpu/gemm.h, NativeLinear) ----------------------------

def require_bf16_gemm():
    if not cpu_kernels.library().bf16_gemm_available():
        pytest.skip("this CPU has no AVX512-BF16: make_linear uses oneDNN (tests/test_linear.py)")


def gemm_paths():
    """Yields each path packed_linear can take here, set for the loop's body: the vdpbf16ps tiles,
    and where the CPU has AMX its tiles too; then restores the setting."""
    previous = cpu_kernels.set_amx_gemm(False)
    try:
        yield "vdpbf16ps"
        if cpu_kernels.amx_gemm_available():
            cpu_kernels.set_amx_gemm(True)
            yield "amx"
    finally:
        cpu_kernels.set_amx_gemm(previous)


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 33, 64, 70, 96, 113])
def test_packed_linear_matches_float64(rows):
    """Row tiles of 1..16 and their remainders (x copied as row tiles below 96 rows, 8-row tiles of
    two column blocks read in place from there, an odd last block alone), column blocks with a
    partial last one, K from one pair to past both prefetch distances; at 1 and 2 threads; rows of
    x strided (a step's slices). Where the CPU has AMX, its tiles too: units of 32 rows and two
    column blocks, a last unit's rows from a copy padded to 16 or 32, an odd last block alone; K
    not a multiple of 32 stays on the vdpbf16ps tiles."""
    require_bf16_gemm()
    from asyncserve.model.linear import NativeLinear
    g = torch.Generator().manual_seed(rows)
    for k, n in [(2, 1), (64, 15), (96, 16), (576, 17), (1538, 130), (576, 960), (128, 40)]:
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        x = torch.randn(rows, 2 * k, generator=g).to(torch.bfloat16)[:, ::2]
        ref = x.double() @ w.double().t()
        packed = NativeLinear.pack(w)
        assert packed.shape == (-(-n // 16), k // 2, 16, 2)
        for path in gemm_paths():
            for _ in at_thread_counts():
                y = cpu_kernels.packed_linear(x, packed, n)
                assert y.shape == (rows, n) and y.dtype == torch.bfloat16
                # fp32 accumulation, one bf16 rounding of the result (2^-9 relative) per element
                torch.testing.assert_close(y.double(), ref, rtol=2 ** -8, atol=1e-5 * ref.abs().max().item(),
                                           msg=lambda m: f"{m}\nrows={rows} k={k} n={n} path={path}")


def test_packed_linear_keeps_a_nan_row_to_itself():
    """A NaN in one row of x (a request's bad activations) reaches that row of y only, on each path."""
    require_bf16_gemm()
    from asyncserve.model.linear import NativeLinear
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(20, 64, generator=g).to(torch.bfloat16)
    x[3, 10] = float("nan")
    for path in gemm_paths():
        y = cpu_kernels.packed_linear(x, NativeLinear.pack(w), 40)
        assert y[3].isnan().all(), path
        assert torch.isfinite(torch.cat([y[:3], y[4:]])).all(), path


def test_packed_linear_refuses_what_it_cannot_compute():
    require_bf16_gemm()
    from asyncserve.model.linear import NativeLinear
    packed = NativeLinear.pack(torch.randn(32, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="in_features must be even"):
        cpu_kernels.packed_linear(torch.randn(4, 63).to(torch.bfloat16), packed, 32)
    with pytest.raises(RuntimeError, match="packed must be"):
        cpu_kernels.packed_linear(torch.randn(4, 62).to(torch.bfloat16), packed, 32)
    with pytest.raises(RuntimeError, match="blocks of 16 columns"):
        cpu_kernels.packed_linear(torch.randn(4, 64).to(torch.bfloat16), packed, 33)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        cpu_kernels.packed_linear(torch.randn(4, 64).half(), packed, 32)


# ---- fp32 GEMM over packed weights (kernels/cpu/gemm.h, AVX2 CPUs without AVX-512) -------------------

def require_fp32_gemm():
    if not cpu_kernels.library().fp32_gemm_available():
        pytest.skip("this build has no AVX2 fp32 GEMM (no AVX2, or AVX-512, where make_linear uses oneDNN)")


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 16, 17, 33, 64, 113, 257])
def test_packed_linear_fp32_matches_float64(rows):
    """Row tiles of 1..6 and their remainders, column blocks with a partial last one, K from 1 to
    past the 256-k chunks (later chunks add into y) and both prefetch distances; at 1 and 2 threads;
    rows of x strided (a step's slices). fp32 products, fp32 sums in another order than float64's."""
    require_fp32_gemm()
    from asyncserve.model.linear import NativeLinear
    g = torch.Generator().manual_seed(rows)
    for k, n in [(1, 1), (64, 15), (96, 16), (256, 17), (257, 33), (576, 130), (1538, 40)]:
        w = torch.randn(n, k, generator=g)
        x = torch.randn(rows, 2 * k, generator=g)[:, ::2]
        ref = x.double() @ w.double().t()
        bound = (x.double().abs() @ w.double().abs().t())   # what the rounding errors scale with
        packed = NativeLinear.pack(w)
        assert packed.shape == (-(-n // 16), k, 16, 1)
        for threads in at_thread_counts():
            y = cpu_kernels.packed_linear(x, packed, n)
            assert y.shape == (rows, n) and y.dtype == torch.float32
            err = ((y.double() - ref).abs() / bound).max().item()
            assert err < k * 2 ** -23, f"rows={rows} k={k} n={n} threads={threads}: relative error {err}"


def test_packed_linear_fp32_keeps_nans_and_infs_to_their_rows():
    """A NaN or an inf in one row of x (a request's bad activations) reaches that row of y only,
    whichever row tile and chunk it falls in."""
    require_fp32_gemm()
    from asyncserve.model.linear import NativeLinear
    g = torch.Generator().manual_seed(7)
    w = NativeLinear.pack(torch.randn(40, 600, generator=g))
    for row, col, bad in [(0, 0, float("nan")), (3, 300, float("inf")), (13, 599, float("-inf")), (16, 255, float("nan"))]:
        x = torch.randn(17, 600, generator=g)
        x[row, col] = bad
        y = cpu_kernels.packed_linear(x, w, 40)
        assert not torch.isfinite(y[row]).any(), (row, col)
        assert torch.isfinite(torch.cat([y[:row], y[row + 1:]])).all(), (row, col)


def test_packed_linear_fp32_refuses_what_it_cannot_compute():
    require_fp32_gemm()
    from asyncserve.model.linear import NativeLinear
    packed = NativeLinear.pack(torch.randn(32, 63))
    with pytest.raises(RuntimeError, match="packed must be"):
        cpu_kernels.packed_linear(torch.randn(4, 62), packed, 32)
    with pytest.raises(RuntimeError, match="packed must be"):      # float32 x over bf16 panels
        cpu_kernels.packed_linear(torch.randn(4, 64), NativeLinear.pack(torch.randn(32, 64).to(torch.bfloat16)), 32)
    with pytest.raises(RuntimeError, match="no packed bf16"):      # a build with the fp32 GEMM has no AVX-512
        cpu_kernels.packed_linear(torch.randn(4, 64).to(torch.bfloat16), packed, 32)
    with pytest.raises(RuntimeError, match="blocks of 16 columns"):
        cpu_kernels.packed_linear(torch.randn(4, 63), packed, 33)


# ---- SiLU * mul and GELU(tanh) * mul -------------------------------------------------------------

def gelu_tanh_float64(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


ACTIVATIONS = {"silu": lambda x: x * torch.sigmoid(x), "gelu_tanh": gelu_tanh_float64}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_gated_mul_matches_float64_and_eager(dtype, activation):
    """SwiGLU's and GeGLU's act(gate) * up: rows 0..40 (one thread's grain and several), odd widths,
    large |gate| both ways (exp never overflows), gates near 0 (tanh's polynomial) and around its
    switch, a strided gate_up (a step's slice); within one rounding of the eager ops."""
    from asyncserve.model import llama
    g = torch.Generator().manual_seed(5)
    for rows, inter in [(0, 8), (1, 1), (3, 17), (16, 1536), (40, 1000)]:
        gate_up = (torch.randn(rows, 2 * inter + 6, generator=g) * 8).to(dtype)[:, 3:3 + 2 * inter]
        gate_up[:, :1] = 100.0 if rows else 0.0
        if inter > 8:
            gate_up[:, 1:9] = torch.tensor([-100.0, -0.3, -0.2, -1e-3, 0.0, 1e-4, 0.2, 0.5]).to(dtype)
        gate, up = gate_up.double().chunk(2, dim=-1)
        ref = ACTIVATIONS[activation](gate) * up
        for _ in at_thread_counts():
            out = getattr(cpu_kernels, f"{activation}_mul")(gate_up)
            assert out.shape == (rows, inter) and out.dtype == dtype
            scale = ref.abs().max().item() if rows else 1.0
            torch.testing.assert_close(out.double(), ref, rtol=ATOL[dtype], atol=ATOL[dtype] * scale * 1e-2)
            eager = getattr(llama, f"{activation}_mul")(gate_up)
            # torch's GELU adds 1 + tanh(u), which cancels for negative u (to exact 0 below some gate):
            # its own error there is up to ~|gate| * 2^-24 * |up|; the kernel keeps the relative precision
            atol = 1e-6 if activation == "silu" else 1e-7 * scale
            torch.testing.assert_close(out, eager, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6, atol=atol)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_gated_mul_keeps_nan_where_it_is(activation):
    x = torch.randn(4, 64)
    x[1, 5] = float("nan")            # gate of column 5
    x[2, 32 + 7] = float("nan")       # up of column 7
    out = getattr(cpu_kernels, f"{activation}_mul")(x)
    assert out[1, 5].isnan() and out[2, 7].isnan() and out.isnan().sum() == 2


# ---- greedy sampling -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_rows_is_torch_argmax(dtype):
    """Random rows, ties (the first wins), a NaN (picked, not finite), +inf, all -inf, vocab sizes
    around the 256-wide blocks, strided rows: the token torch's argmax picks, and its finiteness."""
    g = torch.Generator().manual_seed(9)
    for vocab in (1, 255, 256, 257, 1000, 49152):
        x = (torch.randn(12, vocab + 5, generator=g) * 4).to(dtype)[:, 2:2 + vocab]
        if vocab > 3:
            x[1, 3] = x[1, vocab - 1] = x[1].max() + 1        # a tie: the first
            x[2, vocab // 2] = float("nan")
            x[2, vocab - 1] = float("nan")
            x[3, vocab - 2] = float("inf")
            x[5, :] = x[5, 0]                                  # all equal: 0
        x[4, :] = float("-inf")
        for _ in at_thread_counts():
            tokens, finite = cpu_kernels.greedy_rows(x)
            expected = x.float().argmax(-1)
            assert torch.equal(tokens, expected), (vocab, tokens, expected)
            assert torch.equal(finite, torch.isfinite(x.float().gather(1, expected[:, None])[:, 0])), vocab
