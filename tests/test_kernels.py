"""The Triton LoRA kernels and TritonLoraBackend against a float64 torch reference.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before the kernels
are imported), about 1000x slower than torch, so shapes stay small. Every run draws fresh random
data; the seed is in each assertion message to replay a failure (KERNEL_TEST_SEED=<seed>).

Adapter rows are packed by pool.py's rules (plan_row_packing) into randomly chosen pages of a
PagedPool whose other elements are NaN, so a kernel that reads any element it does not own
(beyond a rank, past a row, another adapter's page) turns its output NaN. Outputs are column
slices of wider tensors and inputs strided, with NaN/garbage around them that must stay
bit-identical.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import kernels  # noqa: E402
from asyncserve.lora.backend import TorchLoraBackend, adapter_spans, group_layout  # noqa: E402
from asyncserve.lora.batch import LoraBatch, SlotTables  # noqa: E402
from asyncserve.model.config import GROUPS, PROJ_INDEX, PROJECTIONS  # noqa: E402
from asyncserve.pager.pager import DeviceAdapter  # noqa: E402
from asyncserve.lora.triton_backend import SGMV_MAX_SEGMENT, TritonLoraBackend  # noqa: E402
from asyncserve.model.config import ModelConfig  # noqa: E402
from asyncserve.model.linear import make_linear, onednn_packs  # noqa: E402
from asyncserve.pager.pool import PagedPool, plan_row_packing  # noqa: E402
from reference import require_native_kernels  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (rtol, atol relative to the largest |expected|): fp32 accumulates exactly enough for 1e-5; bf16
# and fp16 round the output (and, on GPU, the rank-sized intermediate for tensor-core dots).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


def new_seed() -> int:
    env = os.environ.get("KERNEL_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


def make_pool(dtype: torch.dtype, num_pages: int) -> PagedPool:
    # page: 1 layer * 2 * block 4 * 2 heads * 32 = 512 elements, longer than every weight row here
    pool = PagedPool(num_pages, num_layers=1, block_size=4, num_kv_heads=2, head_dim=32, dtype=dtype,
                     device=DEVICE)
    pool.data.fill_(float("nan"))
    return pool


def place_adapter(pool: PagedPool, free: list[int], ranks: list[int], shapes: list[tuple[int, int]],
                  num_layers: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one random adapter into pool pages taken from ``free`` (shuffled), packed as pool.py
    says: (layer, projection, A rows then B^T rows), no row straddling a page.
    Returns (a_ptr, b_ptr) [L, P, r_max] int64 flat offsets, zero beyond each rank."""
    lengths = []
    for _ in range(num_layers):
        for r, (fan_in, fan_out) in zip(ranks, shapes):
            lengths += [fan_in] * r + [fan_out] * r
    n_pages, placements = plan_row_packing(lengths, pool.page_numel)
    pages = [free.pop() for _ in range(n_pages)]
    r_max = max(max(ranks), 1)
    a_ptr = torch.zeros(num_layers, len(ranks), r_max, dtype=torch.int64)
    b_ptr = torch.zeros_like(a_ptr)
    flat = pool.flat
    i = 0
    for layer in range(num_layers):
        for p, (r, (fan_in, fan_out)) in enumerate(zip(ranks, shapes)):
            for ptr, width, std in ((a_ptr, fan_in, fan_in ** -0.5), (b_ptr, fan_out, max(r, 1) ** -0.5)):
                for j in range(r):
                    page, offset = placements[i]
                    start = pages[page] * pool.page_numel + offset
                    ptr[layer, p, j] = start
                    flat[start:start + width] = (torch.randn(width, generator=g) * std).to(flat.dtype).to(DEVICE)
                    i += 1
    return a_ptr.to(DEVICE), b_ptr.to(DEVICE)


def random_layout(g: torch.Generator, n_adapters: int, max_segments: int, max_len: int,
                  decode: bool) -> tuple[list[int], list[int]]:
    """Segment boundaries and adapters: empty and single-token segments, -1 segments, repeats."""
    n = int(torch.randint(1, max_segments + 1, (1,), generator=g))
    starts, adapters = [0], []
    for _ in range(n):
        length = 1 if decode else int(torch.randint(0, max_len + 1, (1,), generator=g))
        starts.append(starts[-1] + length)
        adapters.append(int(torch.randint(-1, n_adapters, (1,), generator=g)))
    if starts[-1] == 0:   # at least one token
        starts[-1] = 1
    # at least one LoRA token: the first non-empty segment gets adapter 0
    first = next(s for s in range(n) if starts[s + 1] > starts[s])
    adapters[first] = max(adapters[first], 0)
    return starts, adapters


def reference_delta(x: torch.Tensor, flat: torch.Tensor, a_ptr: torch.Tensor, b_ptr: torch.Tensor,
                    ranks: torch.Tensor, scaling: torch.Tensor, token_adapter: torch.Tensor,
                    fan_out: int) -> torch.Tensor:
    """float64 LoRA delta [T, out] of one (layer, projection) gathered straight from the pool rows."""
    flat64 = flat.double().cpu()
    x64 = x.double().cpu()
    delta = torch.zeros(x.shape[0], fan_out, dtype=torch.float64)
    for t, a in enumerate(token_adapter.tolist()):
        r = int(ranks[a]) if a >= 0 else 0
        if r == 0:
            continue
        a_rows = flat64[a_ptr[a, :r].cpu()[:, None] + torch.arange(x.shape[1])]    # [r, in]
        b_rows = flat64[b_ptr[a, :r].cpu()[:, None] + torch.arange(fan_out)]      # [r, out]
        delta[t] = float(scaling[a]) * (x64[t] @ a_rows.t()) @ b_rows
    return delta


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def run_case(kernel: str, dtype: torch.dtype, seed: int, *, decode: bool, split_k: int | None = None,
             max_rank: int = 128) -> None:
    g = torch.Generator().manual_seed(seed)
    msg = f"kernel={kernel} dtype={dtype} split_k={split_k} decode={decode} seed={seed}"
    num_layers, n_adapters = 2, int(torch.randint(2, 5, (1,), generator=g))
    # in/out up to 300 so that K, N and rank loops run several blocks (tile caps are 64..256)
    shapes = [tuple(int(v) for v in torch.randint(16, 301, (2,), generator=g)) for _ in range(2)]
    pool = make_pool(dtype, num_pages=6000)     # enough for 4 adapters of rank 128 at one 300-row a page
    free = torch.randperm(pool.num_pages, generator=g).tolist()
    a_ptrs, b_ptrs, ranks = [], [], []
    for i in range(n_adapters):
        r = [int(v) for v in torch.randint(1, max_rank + 1, (len(shapes),), generator=g)]
        if i > 0 and torch.rand(1, generator=g) < 0.3:
            r[int(torch.randint(0, len(r), (1,), generator=g))] = 0    # projection not targeted
        a, b = place_adapter(pool, free, r, shapes, num_layers, g)
        a_ptrs.append(a)
        b_ptrs.append(b)
        ranks.append(r)
    # step tables as LoraBatch.tables() lays them out, one spare column beyond the max rank
    width = max(a.shape[-1] for a in a_ptrs) + 1
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1]))  # noqa: E731
    a_tab = torch.stack([pad(a) for a in a_ptrs])                       # [n, L, P, R]
    b_tab = torch.stack([pad(b) for b in b_ptrs])
    rank_tab = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)    # [n, P]
    scale_tab = (torch.rand(n_adapters, num_layers, len(shapes), generator=g) + 0.5).to(DEVICE)

    layer, p = int(torch.randint(0, num_layers, (1,), generator=g)), int(torch.randint(0, len(shapes), (1,), generator=g))
    fan_in, fan_out = shapes[p]
    a_view, b_view = a_tab[:, layer, p, :], b_tab[:, layer, p, :]
    rank_view, scale_view = rank_tab[:, p], scale_tab[:, layer, p]

    seg_starts, seg_adapter = random_layout(g, n_adapters, 6 if decode else 5, 20, decode)
    tokens = seg_starts[-1]
    token_adapter = torch.full((tokens,), -1, dtype=torch.int32)
    for s, a in enumerate(seg_adapter):
        token_adapter[seg_starts[s]:seg_starts[s + 1]] = a
    token_adapter = token_adapter.to(DEVICE)

    # x: strided rows inside a NaN-padded buffer; y: a column slice of a wider poisoned output
    x_big = torch.full((tokens, fan_in + 7), float("nan"), dtype=dtype, device=DEVICE)
    x_big[:, 3:3 + fan_in] = torch.randn(tokens, fan_in, generator=g).to(dtype).to(DEVICE)
    x = x_big[:, 3:3 + fan_in]
    y_big = torch.full((tokens, fan_out + 11), float("nan"), dtype=dtype, device=DEVICE)
    lora_rows = torch.tensor([a >= 0 and ranks[a][p] > 0 for a in token_adapter.tolist()], dtype=torch.bool)
    y_big[lora_rows.to(DEVICE), 5:5 + fan_out] = torch.randn(int(lora_rows.sum()), fan_out, generator=g).to(dtype).to(DEVICE)
    before = y_big.clone()
    y = y_big[:, 5:5 + fan_out]

    s = torch.full((tokens + 2, width + 3), float("nan"), dtype=torch.float32, device=DEVICE)
    seg_t = torch.tensor(seg_starts, dtype=torch.int32, device=DEVICE)
    seg_a = torch.tensor(seg_adapter, dtype=torch.int32, device=DEVICE)
    tiles = kernels.mbgmm_tiles(seg_starts, seg_adapter, DEVICE, block_m=16)
    kernels.lora_apply(kernel, x, y, pool.flat, a_view, b_view, rank_view, scale_view, s,
                       token_adapter=token_adapter, seg_starts=seg_t, seg_adapter=seg_a, tiles=tiles,
                       split_k=split_k)

    delta = reference_delta(x, pool.flat, a_view, b_view, rank_view, scale_view, token_adapter, fan_out)
    touched = torch.zeros(tokens, fan_out + 11, dtype=torch.bool)
    touched[lora_rows, 5:5 + fan_out] = True
    after = y_big.cpu()
    assert torch.equal(bits(after)[~touched], bits(before.cpu())[~touched]), f"untouched elements changed: {msg}"
    expected = before.cpu().double()[:, 5:5 + fan_out][lora_rows] + delta[lora_rows]
    got = after.double()[:, 5:5 + fan_out][lora_rows]
    if expected.numel():
        rtol, atol = TOLERANCE[dtype]
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol * float(expected.abs().max()),
                                   msg=lambda m: f"{m}\n{msg}")


DRAWS = 3     # fresh random problems per case
CASES = [
    ("mbgmv", torch.float32, True, 1),
    ("mbgmv", torch.bfloat16, True, 2),
    ("mbgmv", torch.float32, False, None),    # per-token semantics hold on any layout
    ("bgmv", torch.float32, True, 1),
    ("bgmv", torch.bfloat16, True, 3),
    ("sgmv", torch.float32, False, 1),
    ("sgmv", torch.bfloat16, False, 3),
    ("sgmv", torch.float16, True, 2),
    ("mbgmm", torch.float32, False, None),
    ("mbgmm", torch.bfloat16, False, None),
    ("mbgmm", torch.float16, True, None),
]


@pytest.mark.parametrize("kernel,dtype,decode,split_k", CASES,
                         ids=[f"{k}-{str(d)[6:]}-{'decode' if dec else 'segments'}-sk{sk}" for k, d, dec, sk in CASES])
def test_kernel_matches_float64_reference(kernel, dtype, decode, split_k):
    for _ in range(DRAWS):
        run_case(kernel, dtype, new_seed(), decode=decode, split_k=split_k)


@pytest.mark.parametrize("dtype,padded", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_mbgmv_fused_group_matches_float64_reference(dtype, padded):
    """q, k, v in one launch: three projections of one input, widths side by side in y."""
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    msg = f"dtype={dtype} padded={padded} seed={seed}"
    fan_in = int(torch.randint(16, 301, (1,), generator=g))
    outs = [int(v) for v in torch.randint(16, 301, (3,), generator=g)]
    shapes = [(fan_in, o) for o in outs]
    pool = make_pool(dtype, num_pages=6000)
    free = torch.randperm(pool.num_pages, generator=g).tolist()
    n_adapters = 3
    placed, ranks = [], []
    for i in range(n_adapters):
        r = [int(v) for v in torch.randint(1, 129, (3,), generator=g)]
        r[i] = 0                                  # each adapter skips one projection
        placed.append(place_adapter(pool, free, r, shapes, 1, g))
        ranks.append(r)
    width = max(a.shape[-1] for a, _ in placed)
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1]))  # noqa: E731
    a_tab = torch.stack([pad(a)[0] for a, _ in placed])                # [n, 3, R]
    b_tab = torch.stack([pad(b)[0] for _, b in placed])
    rank_tab = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)  # [n, 3]
    scale_tab = (torch.rand(n_adapters, 3, generator=g) + 0.5).to(DEVICE)
    seg_starts, seg_adapter = random_layout(g, n_adapters, 6, 20, True)
    tokens = seg_starts[-1]
    token_adapter = torch.full((tokens,), -1, dtype=torch.int32)
    for s_, a in enumerate(seg_adapter):
        token_adapter[seg_starts[s_]:seg_starts[s_ + 1]] = a
    token_adapter = token_adapter.to(DEVICE)
    x = torch.randn(tokens, fan_in, generator=g).to(dtype).to(DEVICE)
    total = sum(outs)
    y_big = torch.full((tokens, total + 9), float("nan"), dtype=dtype, device=DEVICE)
    lora_rows = token_adapter.cpu() >= 0
    y_big[lora_rows.to(DEVICE), 4:4 + total] = torch.randn(int(lora_rows.sum()), total, generator=g).to(dtype).to(DEVICE)
    before = y_big.clone().cpu()
    s = torch.full((tokens, 3 * width), float("nan"), dtype=torch.float32, device=DEVICE)
    kernels.mbgmv_shrink(x, pool.flat, a_tab, rank_tab, token_adapter, s, padded=padded)
    kernels.mbgmv_expand(s, pool.flat, b_tab, rank_tab, scale_tab, token_adapter, y_big[:, 4:4 + total],
                         out_sizes=tuple(outs), padded=padded)
    after = y_big.cpu()
    touched = torch.zeros(tokens, total + 9, dtype=torch.bool)
    touched[lora_rows, 4:4 + total] = True
    assert torch.equal(bits(after)[~touched], bits(before)[~touched]), f"untouched elements changed: {msg}"
    col = 4
    for p, fan_out in enumerate(outs):
        delta = reference_delta(x, pool.flat, a_tab[:, p], b_tab[:, p], rank_tab[:, p], scale_tab[:, p],
                                token_adapter, fan_out)
        expected = before.double()[lora_rows, col:col + fan_out] + delta[lora_rows]
        got = after.double()[lora_rows, col:col + fan_out]
        rtol, atol = TOLERANCE[dtype]
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol * float(expected.abs().max()),
                                   msg=lambda m: f"{m}\nprojection {p}: {msg}")
        col += fan_out


def test_mbgmm_tiles_cut_segments_and_skip_no_lora():
    tiles = kernels.mbgmm_tiles([0, 5, 5, 6, 40, 41], [2, 0, -1, 1, 3], "cpu", block_m=16)
    assert tiles.block_m == 16
    assert tiles.table.tolist() == [[0, 5, 2], [6, 22, 1], [22, 38, 1], [38, 40, 1], [40, 41, 3]]
    assert kernels.mbgmm_tiles([0, 3], [-1], "cpu").table.shape == (0, 3)


TINY = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=12)


def seeded_step(dtype: torch.dtype, decode: bool) -> tuple[int, torch.Generator, PagedPool, LoraBatch]:
    """A fresh seed (printed by failing tests), its generator, a pool and a random step in it."""
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    pool = make_pool(dtype, num_pages=2000)
    return seed, g, pool, make_step(g, pool, decode=decode)


def make_adapters(g: torch.Generator, pool: PagedPool, rank_ranges: list[tuple[int, int]]) -> list[DeviceAdapter]:
    """Random adapters placed in the pool, one per (lowest, highest) rank range (the ranks of its
    projections drawn from it), some projections untargeted."""
    shapes = [TINY.projection_shapes()[name] for name in PROJECTIONS]
    free = torch.randperm(pool.num_pages, generator=g).tolist()
    adapters = []
    for i, (low, high) in enumerate(rank_ranges):
        ranks = [int(v) for v in torch.randint(low, high + 1, (len(PROJECTIONS),), generator=g)]
        for p in torch.randperm(len(PROJECTIONS), generator=g)[:int(torch.randint(0, 4, (1,), generator=g))]:
            ranks[int(p)] = 0    # untargeted projections, a whole group sometimes
        a_ptr, b_ptr = place_adapter(pool, free, ranks, shapes, TINY.num_layers, g)
        scaling = (torch.rand(TINY.num_layers, len(PROJECTIONS), generator=g) + 0.5).to(DEVICE)
        adapters.append(DeviceAdapter(f"a{i}", ranks, a_ptr, b_ptr, scaling, [], generation=i))
    return adapters


def make_step(g: torch.Generator, pool: PagedPool, decode: bool) -> LoraBatch:
    adapters = make_adapters(g, pool, [(1, 128)] * 3)
    seg_starts, seg_adapter = random_layout(g, len(adapters), 8, 12, decode)
    return LoraBatch(adapters, seg_starts, seg_adapter, seg_starts[-1], DEVICE)


@pytest.mark.parametrize("mode", ["decode", "mbgmm", "sgmv"])
def test_triton_backend_matches_torch_backend(mode):
    """Every group and layer of a random step: fused output columns, untargeted projections, -1 segments."""
    seed, g, pool, batch = seeded_step(torch.float32, decode=mode == "decode")
    reference = TorchLoraBackend(pool, TINY)
    backend = TritonLoraBackend(pool, TINY, prefill_kernel="sgmv" if mode == "sgmv" else "mbgmm")
    reference.begin_step(batch)
    backend.begin_step(batch)
    assert backend.active
    layout = group_layout(TINY)
    for layer in range(TINY.num_layers):
        for group in GROUPS:
            fan_in = layout[group][0][1]
            fan_out = sum(row[2] for row in layout[group])
            x = torch.randn(batch.num_tokens, fan_in, generator=g).to(DEVICE)
            y = torch.randn(batch.num_tokens, fan_out, generator=g).to(DEVICE)
            expected = y.clone()
            reference.apply(layer, group, x, expected)
            backend.apply(layer, group, x, y)
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4,
                                       msg=lambda m: f"{m}\nmode={mode} layer={layer} group={group} seed={seed}")
    backend.begin_step(None)
    assert not backend.active


def test_triton_backend_keeps_its_tables_across_steps():
    """The step tables live on the device across steps (SlotTables): steps whose adapters come and go
    fill only the new ones' slots, reuse the least recently used slot once the tables are full, and
    grow them for more adapters or a larger rank than they hold; every step still equals a fresh torch
    backend's (loop plan) deltas."""
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    pool = make_pool(torch.float32, num_pages=2000)
    *adapters, big = make_adapters(g, pool, [(1, 8)] * 5 + [(9, 24)])
    backend = TritonLoraBackend(pool, TINY)
    backend.slot_tables = SlotTables(TINY.num_layers, len(PROJECTIONS), DEVICE, slots=2, max_rank=1)
    # (step adapters, decode): fill, reuse the least recent slot, grow the slots
    for chosen, decode in (([0, 1], True), ([2], False), ([1, 3], True), ([0, 1, 2, 3, 4], False), ([3], True)):
        # a base-model segment, then one segment per step adapter, each in the step
        lengths = [2] + [1 if decode else int(torch.randint(1, 13, (1,), generator=g)) for _ in chosen]
        seg_starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        batch = LoraBatch([adapters[i] for i in chosen], seg_starts, [-1, *range(len(chosen))], seg_starts[-1],
                          DEVICE, num_decode=seg_starts[-1] if decode else 0)
        reference = TorchLoraBackend(pool, TINY, mode="loop")
        reference.begin_step(batch)
        backend.begin_step(batch)
        assert backend.active
        assert_same_deltas(reference, backend, batch, torch.float32, g, seed)
    assert backend.slot_tables.tensors[0].shape[0] >= 5
    # grow the rank
    batch = LoraBatch([big, adapters[0]], [0, 3, 4], [0, 1], 4, DEVICE, num_decode=4)
    reference = TorchLoraBackend(pool, TINY, mode="loop")
    reference.begin_step(batch)
    backend.begin_step(batch)
    assert backend.slot_tables.tensors[1].shape[-1] == big.r_max > 8
    assert_same_deltas(reference, backend, batch, torch.float32, g, seed)


def backend_tolerance(dtype: torch.dtype, expected: torch.Tensor) -> dict:
    """Two torch-backend paths on the same step: in bf16 both round the shrink to bf16, then differ
    in where the expand is rounded (a few ulps of the output's scale)."""
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-4)
    return dict(rtol=0.0, atol=0.01 * float(expected.abs().max()))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", [True, False])
def test_torch_backend_loop_equals_stacked(decode, dtype, packed):
    """The segmented per-adapter loop (plain GEMMs on the stacks) and the stacked-masked GEMM, over
    the stacks as they are or (packed, once a set has lasted) make_linear's copies, which on CPU
    are oneDNN's reordered layout, give the same deltas."""
    seed, g, pool, batch = seeded_step(dtype, decode=decode)
    stacked = TorchLoraBackend(pool, TINY, mode="stacked", pack_after_steps=2)
    loop = TorchLoraBackend(pool, TINY, mode="loop")
    for _ in range(2 if packed else 1):
        stacked.begin_step(batch)
    loop.begin_step(batch)
    assert {kind for kind, _ in loop._plans.values()} == {"loop"}
    assert {layer.packed for layers in stacked._linears.values() for layer in layers} == {packed}
    assert_same_deltas(stacked, loop, batch, dtype, g, seed)


def assert_same_deltas(expected_backend, backend, batch, dtype, g, seed) -> None:
    """Both backends (begun on ``batch``) add the same LoRA deltas to random y for random x, in every
    layer and group."""
    layout = group_layout(TINY)
    for layer in range(TINY.num_layers):
        for group in GROUPS:
            x = torch.randn(batch.num_tokens, layout[group][0][1], generator=g).to(DEVICE, dtype)
            y = torch.randn(batch.num_tokens, sum(row[2] for row in layout[group]), generator=g).to(DEVICE, dtype)
            expected = y.clone()
            expected_backend.apply(layer, group, x, expected)
            backend.apply(layer, group, x, y)
            torch.testing.assert_close(y, expected, **backend_tolerance(dtype, expected),
                                       msg=lambda m: f"{m}\nlayer={layer} group={group} seed={seed}")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the native kernels are CPU kernels (the pool is on CUDA here)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", [True, False])
def test_torch_backend_native_equals_loop(decode, dtype):
    """auto with the native kernels: one lora_segments call per group, reading the adapters' rows from
    the pool pages (NaN everywhere else), gives the per-adapter loop's deltas; -1 segments untouched."""
    require_native_kernels()
    seed, g, pool, batch = seeded_step(dtype, decode=decode)
    native, loop = TorchLoraBackend(pool, TINY), TorchLoraBackend(pool, TINY, mode="loop")
    native.native = True                    # also under ASYNCSERVE_NATIVE=0, which only keeps the engine off it
    native.begin_step(batch)
    loop.begin_step(batch)
    assert {kind for kind, _ in native._plans.values()} == {"native"}
    assert_same_deltas(loop, native, batch, dtype, g, seed)


def test_torch_backend_loops_over_many_distinct_adapters():
    """auto: one stacked GEMM for a few adapters, the per-adapter loop when tokens x sum(ranks) explodes."""
    g = torch.Generator().manual_seed(0)
    pool = make_pool(torch.float32, num_pages=2000)
    few = make_step(g, pool, decode=True)
    backend = TorchLoraBackend(pool, TINY)
    backend.native = False                  # auto's choice between its eager plans
    backend.begin_step(LoraBatch(few.adapters[:1], [0, 4], [0], 4, DEVICE, num_decode=4))
    assert {kind for kind, _ in backend._plans.values()} == {"stacked"}
    big = ModelConfig(vocab_size=64, hidden_size=4096, intermediate_size=64, num_layers=1, num_heads=32,
                      num_kv_heads=32, head_dim=128)
    rank = 64
    adapters = [DeviceAdapter(f"d{i}", [rank, 0, 0, 0, 0, 0, 0],
                              torch.zeros(1, len(PROJECTIONS), rank, dtype=torch.int64, device=DEVICE),
                              torch.zeros(1, len(PROJECTIONS), rank, dtype=torch.int64, device=DEVICE),
                              torch.ones(1, len(PROJECTIONS), device=DEVICE), [], generation=i) for i in range(32)]
    pool_big = PagedPool(4, num_layers=1, block_size=4, num_kv_heads=32, head_dim=128, dtype=torch.float32,
                         device=DEVICE)
    backend = TorchLoraBackend(pool_big, big, build_bytes_per_step=2**40)      # its 168 MB of stacks at once
    backend.native = False
    # a turn's cost as measured on quiet CPUs (0 to 1.5e6 multiply-adds); measured on a loaded box
    # it can come out 30x higher, and the choice with it
    backend.turn_macs = {group: 1.5e6 for group in backend.turn_macs}
    backend.begin_step(LoraBatch(adapters, list(range(33)), list(range(32)), 32, DEVICE, num_decode=32))
    assert backend._plans["qkv"][0] == "loop"


def test_torch_backend_chooses_by_the_documented_costs():
    """auto picks the loop exactly when its multiply-adds (each span's rows x its own rank x (in + out))
    plus one measured turn cost per span come to less than the stacked GEMMs' (tokens x R x (in + out))."""
    g = torch.Generator().manual_seed(0)
    pool = make_pool(torch.float32, num_pages=2000)
    batch = make_step(g, pool, decode=False)
    backend = TorchLoraBackend(pool, TINY)
    backend.native = False
    layout = group_layout(TINY)
    for group, rows in layout.items():
        fan_in, fan_out = rows[0][1], sum(r[2] for r in rows)
        ranks = [sum(a.ranks[PROJ_INDEX[proj]] for proj, *_ in rows) for a in batch.adapters]
        if not any(ranks):
            continue
        spans = adapter_spans(batch)
        own = sum((sl.stop - sl.start) * ranks[i] for i, runs in spans.items() for sl in runs if ranks[i])
        turns = sum(len(runs) for i, runs in spans.items() if ranks[i])
        stacked = batch.num_tokens * sum(ranks) * (fan_in + fan_out)
        even = (stacked - own * (fan_in + fan_out)) / turns          # the turn cost where both are equal
        for turn, kind in ((even * 0.9, "loop"), (even * 1.1, "stacked")):
            backend.turn_macs = {name: turn for name in layout}
            backend.begin_step(batch)
            assert backend._plans[group][0] == kind, (group, turn, even)


def test_triton_backend_kernel_choice():
    g = torch.Generator().manual_seed(0)
    pool = make_pool(torch.float32, num_pages=2000)
    batch = make_step(g, pool, decode=True)
    backend = TritonLoraBackend(pool, TINY)
    backend.begin_step(batch)
    assert backend._step.kernel == "mbgmv"
    # a long segment of "no LoRA" tokens keeps the step a decode step
    batch = LoraBatch(batch.adapters, [0, 7, 8], [-1, 1], 8, DEVICE)
    backend.begin_step(batch)
    assert backend._step.kernel == "mbgmv"
    # the engine merges decodes of one adapter into one segment: still a decode step
    backend.begin_step(LoraBatch(batch.adapters, [0, 4, 6], [0, 1], 6, DEVICE, num_decode=6))
    assert backend._step.kernel == "mbgmv"
    # prefill segments: SGMV while short, MBGMM from SGMV_MAX_SEGMENT tokens on
    backend.begin_step(LoraBatch(batch.adapters, [0, 4, 6], [0, 1], 6, DEVICE, num_decode=4))
    assert backend._step.kernel == "sgmv"
    long = SGMV_MAX_SEGMENT
    backend.begin_step(LoraBatch(batch.adapters, [0, 1, 1 + long], [0, 1], 1 + long, DEVICE, num_decode=1))
    assert backend._step.kernel == "mbgmm"


def test_generate_with_triton_backend_equals_torch_backend(tiny_model):
    """End to end: prefill chunks and decodes of every adapter (ranks 1..64) and the base share steps."""
    from asyncserve import LLM, SamplingParams

    paths = {name: str(path) for name, path in tiny_model.adapters.items()}
    tok = tiny_model.tokenizer
    prompts = [tok.encode(text) for text in ("the fox jumps over the lazy dog", "serve many adapters",
                                             "rank", "low rank updates to their projections batch token step")]
    cases = [(ids, name) for ids in prompts[:2] for name in [None, *paths]] + [(prompts[2], "r64_all"),
                                                                              (prompts[3], "r16_patterns")]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tiny_model.root), adapters=paths, dtype="float32", device=DEVICE.type,
                  lora_backend=backend, max_step_tokens=16)
        assert llm.engine.lora_backend_name == backend
        outputs[backend] = [o.token_ids for o in llm.generate([c[0] for c in cases], params,
                                                              adapters=[c[1] for c in cases])]
    for i, (ids, name) in enumerate(cases):
        assert outputs["triton"][i] == outputs["torch"][i], f"case {i} adapter {name}"


@pytest.mark.parametrize("mode", ["stacked", "loop"])
def test_torch_backend_reuses_stacks_when_a_step_lists_its_adapters_in_another_order(mode):
    """Same adapters, same tokens, the step's adapter table permuted: the stacks are not rebuilt and
    every delta equals that of a fresh backend."""
    seed, g, pool, batch = seeded_step(torch.float32, decode=False)
    perm = [2, 0, 1]                                      # new table position -> old
    new_index = {old: new for new, old in enumerate(perm)}
    permuted = LoraBatch([batch.adapters[i] for i in perm], batch.seg_starts,
                         [new_index[a] if a >= 0 else -1 for a in batch.seg_adapter], batch.num_tokens, DEVICE)
    backend, fresh = TorchLoraBackend(pool, TINY, mode=mode), TorchLoraBackend(pool, TINY, mode=mode)
    backend.begin_step(batch)
    stacks = backend._stacks
    backend.begin_step(permuted)
    fresh.begin_step(batch)
    assert backend._stacks is stacks
    layout = group_layout(TINY)
    for layer in range(TINY.num_layers):
        for group in GROUPS:
            x = torch.randn(batch.num_tokens, layout[group][0][1], generator=g).to(DEVICE)
            y = torch.randn(batch.num_tokens, sum(row[2] for row in layout[group]), generator=g).to(DEVICE)
            expected = y.clone()
            fresh.apply(layer, group, x, expected)
            backend.apply(layer, group, x, y)
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4,
                                       msg=lambda m: f"{m}\nlayer={layer} group={group} seed={seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_builds_packs_and_fuses_a_layer_per_step_with_equal_outputs(dtype):
    """With no byte budget each step builds one layer of one group's stacks, then packs and fuses one
    layer per step: until the stacks are complete the step reads each adapter's rows from the pool;
    at every step project() equals a backend that did everything at once (issue 12: a large set
    built in one step stalled every stream)."""
    seed, g, pool, batch = seeded_step(dtype, decode=True)
    pieces = TorchLoraBackend(pool, TINY, mode="stacked", pack_after_steps=1, build_bytes_per_step=0)
    at_once = TorchLoraBackend(pool, TINY, mode="stacked", pack_after_steps=1, build_bytes_per_step=2**40)
    layout = group_layout(TINY)
    groups = [group for group in GROUPS if any(a.ranks[PROJ_INDEX[p]] for a in batch.adapters for p, *_ in layout[group])]
    bases = {(layer, group): make_linear((torch.randn(sum(r[2] for r in layout[group]), layout[group][0][1],
                                                      generator=g) * 0.1).to(DEVICE, dtype))
             for layer in range(TINY.num_layers) for group in GROUPS}
    kinds = []
    for _ in range(3 * len(groups) * TINY.num_layers + 1):
        pieces.begin_step(batch)
        at_once.begin_step(batch)
        kinds.append({kind for kind, _ in pieces._plans.values()})
        for (layer, group), base in bases.items():
            x = torch.randn(batch.num_tokens, layout[group][0][1], generator=g).to(DEVICE, dtype)
            expected = at_once.project(layer, group, x, base)
            got = pieces.project(layer, group, x, base)
            torch.testing.assert_close(got, expected, **backend_tolerance(dtype, expected),
                                       msg=lambda m: f"{m}\nlayer={layer} group={group} seed={seed}")
    steps_to_build = len(groups) * TINY.num_layers               # one layer of one group per step
    assert kinds[:steps_to_build - 1] == [{"pool"}] * (steps_to_build - 1), kinds
    assert kinds[steps_to_build - 1:] == [{"stacked"}] * (len(kinds) - steps_to_build + 1), kinds
    assert all(linears.packed for layers in pieces._linears.values() for linears in layers)
    assert pieces._fused.keys() == at_once._fused.keys()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_project_with_the_shrink_on_the_base_gemm(dtype):
    """Once a set is packed, project() runs x @ [W; A_stack]^T in one GEMM (where oneDNN packs the
    dtype): its output equals the base projection plus the unfused backend's deltas."""
    seed, g, pool, batch = seeded_step(dtype, decode=True)
    fused = TorchLoraBackend(pool, TINY, mode="stacked", pack_after_steps=1)
    reference = TorchLoraBackend(pool, TINY, mode="stacked")
    fused.begin_step(batch)
    reference.begin_step(batch)
    layout = group_layout(TINY)
    for layer in range(TINY.num_layers):
        for group in GROUPS:
            fan_in, fan_out = layout[group][0][1], sum(row[2] for row in layout[group])
            base = make_linear((torch.randn(fan_out, fan_in, generator=g) * fan_in ** -0.5).to(DEVICE, dtype))
            x = torch.randn(batch.num_tokens, fan_in, generator=g).to(DEVICE, dtype)
            expected = base(x)
            reference.apply(layer, group, x, expected)
            got = fused.project(layer, group, x, base)
            tol = backend_tolerance(dtype, expected)
            torch.testing.assert_close(got, expected, **tol, msg=lambda m: f"{m}\nlayer={layer} group={group} seed={seed}")
    was_fused = [f is not None for f in fused._fused.values()]
    assert was_fused and all(was_fused) == onednn_packs(pool.device, dtype)
