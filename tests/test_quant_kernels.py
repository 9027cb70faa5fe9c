"""kernels.cpu.quant_linear (kernels/cpu/quant.h) against float64 references built from gguf.quants'
dequantization of the same blocks, for every type, odd shapes and 1..256 rows.

The kernel quantizes the activations to int8 per block of 32 (scale d = max |x| / 127, q = round(x / d)),
or of 256 for Q4_K and Q5_K (llama.cpp's q8_K, whose integer sums fold to float once per super-block).
Two checks per output element: against x @ W^T with the activations quantized the same way (replicated
here in float32), to fp32 accumulation's error (and bf16 rounding of the result): the integer dot
products and the block scales are exact; and against the exact x @ W^T within the rigorous bound of
the activations' rounding, |x_i - d q_i| <= d / 2: sum over blocks of d / 2 * sum |w_i| in the block.
"""
import numpy as np
import pytest
import torch

import kernels.cpu as cpu_kernels
from asyncserve.model.linear import QuantizedWeight
from quant_helpers import KERNEL_TYPES, Q, dequantized, quantize, random_blocks
from reference import require_native_kernels

ROWS = [1, 3, 17, 64, 256]


@pytest.fixture(scope="module", autouse=True)
def native():
    require_native_kernels()


def activation_block(qtype: Q) -> int:
    """The activations' quantization block against weights of qtype."""
    return 256 if qtype in (Q.Q4_K, Q.Q5_K) else 32


def activation_bound(x: torch.Tensor, w: np.ndarray, block: int) -> np.ndarray:
    """[rows, out]: the most the int8 activations (per block) can move x @ w.T."""
    x64 = x.double().numpy()
    rows, fan_in = x64.shape
    d = np.abs(x64).reshape(rows, fan_in // block, block).max(-1) / 127                      # [rows, blocks]
    wsum = np.abs(w.astype(np.float64)).reshape(w.shape[0], fan_in // block, block).sum(-1)  # [out, blocks]
    return d / 2 @ wsum.T


def int8_activations(x: torch.Tensor, block: int) -> np.ndarray:
    """x as the kernel multiplies it: per block, d * round(x / d) with d = max |x| / 127 (float32)."""
    x32 = x.float().numpy()
    rows, fan_in = x32.shape
    blocks = x32.reshape(rows, fan_in // block, block)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(blocks * inv).astype(np.float64) * d).reshape(rows, fan_in)


def assert_within(y: torch.Tensor, ref: np.ndarray, tol: np.ndarray, what: str) -> None:
    err = np.abs(y.double().numpy() - ref)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert (err <= tol).all(), f"{what}: error {err[worst]:.3g} > tolerance {tol[worst]:.3g} at {worst}"


def check(x: torch.Tensor, parts: list[tuple[np.ndarray, Q]], panels: bool = False) -> None:
    """quant_linear over parts against the references; panels: its Q4_0, Q4_1, Q4_K, Q5_K and Q6_K parts repacked
    into panels of 8 columns first (QuantizedWeight.in_panels: those whose rows are a multiple of 8)."""
    held = QuantizedWeight([(torch.from_numpy(b), int(t)) for b, t in parts], x.shape[1])
    held = held.in_panels() if panels else held
    y = cpu_kernels.quant_linear(x, [b for b, _ in held.parts], [t for _, t in held.parts])
    assert y.dtype == x.dtype and tuple(y.shape) == (x.shape[0], sum(len(b) for b, _ in parts))
    for part, (blocks, qtype) in zip(y.split([len(b) for b, _ in parts], dim=1), parts):
        w = dequantized(blocks, qtype).astype(np.float64)
        block = activation_block(qtype)
        rounding = np.abs(x.double().numpy()) @ np.abs(w).T * 1e-5 + 1e-6   # fp32 accumulation
        exact = x.double().numpy() @ w.T
        output = np.abs(exact) * 2.0 ** -8 if x.dtype == torch.bfloat16 else 0.0
        assert_within(part, int8_activations(x, block) @ w.T, rounding + output,
                      f"{qtype.name} against the same int8 activations")
        assert_within(part, exact, activation_bound(x, w, block) + rounding + output,
                      f"{qtype.name} against the exact activations")


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_each_type_rows_and_odd_shapes(qtype):
    rng = np.random.default_rng(int(qtype))
    block = 256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
    fan_in, out = 3 * block, 37            # several blocks; out not a multiple of any tile
    blocks = random_blocks((out, fan_in), qtype, rng)
    for rows in ROWS:
        x = torch.from_numpy(rng.standard_normal((rows, fan_in)).astype(np.float32))
        for dtype in (torch.float32, torch.bfloat16):
            check(x.to(dtype), [(blocks, qtype)])


PANEL_ROWS = [1, 3, 4, 5, 7, 8, 9, 63, 64, 65, 255, 256]   # around the row tiles (4) and the panel threshold (8)


@pytest.fixture
def panel_rows():
    """Sets quant_linear's panel threshold for a test (kernels.cpu.set_quant_panel_rows), restored after."""
    previous = cpu_kernels.set_quant_panel_rows(8)
    yield cpu_kernels.set_quant_panel_rows
    cpu_kernels.set_quant_panel_rows(previous)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_panels_and_columns_at_tile_boundaries(qtype, panel_rows):
    """Both int8 paths, panels of 8 columns (from any row count, forced) and a column at a time (at any,
    forced), at row counts around their tiles, against the references; a last panel of 5 columns."""
    rng = np.random.default_rng(30 + int(qtype))
    block = 256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
    blocks = random_blocks((21, 2 * block), qtype, rng)
    x = torch.from_numpy(rng.standard_normal((max(PANEL_ROWS), 2 * block)).astype(np.float32))
    for threshold in (1, 2 ** 62):
        panel_rows(threshold)
        for rows in PANEL_ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                check(x[:rows].to(dtype), [(blocks, qtype)])


def test_panels_give_the_columns_results_to_rounding(panel_rows):
    """Panels and columns multiply the same int8 activations: their results differ by fp32 rounding alone,
    across the mixed parts of a Q4_K_M qkv at a prefill's rows, with 1 and 2 threads."""
    rng = np.random.default_rng(5)
    parts = [torch.from_numpy(random_blocks((out, 1024), t, rng))
             for out, t in [(64, Q.Q4_K), (16, Q.Q5_K), (16, Q.Q6_K), (13, Q.Q8_0), (8, Q.Q4_0), (3, Q.Q4_1)]]
    types = [int(t) for t in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q4_1)]
    x = torch.randn(70, 1024)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            for threshold in (1, 2 ** 62):
                panel_rows(threshold)
                results.append(cpu_kernels.quant_linear(x, parts, types))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[3])   # threads split columns
    scale = (x.abs() @ torch.cat([torch.from_numpy(dequantized(p.numpy(), Q(t))) for p, t in zip(parts, types)]).abs().T)
    assert ((results[0] - results[1]).abs() <= scale * 1e-5 + 1e-6).all()


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_panels_of_each_type_match_columns_on_any_threads(qtype, panel_rows):
    """Each type's panels (their blocks decoded in registers and transposed, the scales gathered across 8
    columns) at a decode step's 16 rows and a prefill's 37: the columns' results to fp32 rounding, the
    same bits on 1 and 2 threads (the rows' quantization and the panels split between them); K of 3 and
    5 blocks, a last panel of 3 columns."""
    rng = np.random.default_rng(60 + int(qtype))
    block = 256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
    threads = torch.get_num_threads()
    try:
        for fan_in in (3 * block, 5 * block):
            blocks = random_blocks((43, fan_in), qtype, rng)
            w = torch.from_numpy(dequantized(blocks, qtype))
            for rows in (16, 37):
                x = torch.from_numpy(rng.standard_normal((rows, fan_in)).astype(np.float32))
                results = {}
                for n in (1, 2):
                    torch.set_num_threads(n)
                    for threshold in (1, 2 ** 62):
                        panel_rows(threshold)
                        results[n, threshold] = cpu_kernels.quant_linear(x, [torch.from_numpy(blocks)], [int(qtype)])
                assert torch.equal(results[1, 1], results[2, 1]) and torch.equal(results[1, 2 ** 62], results[2, 2 ** 62])
                scale = x.abs() @ w.abs().T
                assert ((results[1, 1] - results[1, 2 ** 62]).abs() <= scale * 1e-5 + 1e-6).all(), (fan_in, rows)
                panel_rows(1)
                check(x, [(blocks, qtype)])   # the panels against the float64 references
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def panels():
    """Q4_0, Q4_1, Q4_K, Q5_K and Q6_K in panels of 8 columns run where the build runs panels (AVX2 and F16C)."""
    if not cpu_kernels.quant_panels():
        pytest.skip("this build runs no panels (no AVX2 or F16C): the blocks stay GGUF's")


PANEL_KINDS = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
BLOCK_BYTES = {Q.Q4_0: (32, 18, 18), Q.Q4_1: (32, 20, 20), Q.Q4_K: (256, 144, 148), Q.Q5_K: (256, 176, 180),
               Q.Q6_K: (256, 210, 210)}  # weights,
# bytes per block and per column's share of a panel


@pytest.mark.parametrize("qtype", PANEL_KINDS, ids=lambda t: t.name)
@pytest.mark.parametrize("out, fan_in", [(8, 256), (24, 768), (64, 512)])
def test_panels_give_the_blocks_back_bit_for_bit(qtype, out, fan_in):
    """to_panels (into a new tensor or a given one) then from_panels: the same bytes, for blocks of any bits
    (every bit of these blocks is some value's); Q4_K's panels hold 148 bytes per 144, Q5_K's 180 per 176,
    the others as many as their blocks."""
    rng = np.random.default_rng(out + fan_in + int(qtype))
    weights, size, panel_size = BLOCK_BYTES[qtype]
    blocks = torch.from_numpy(random_blocks((out, fan_in), qtype, rng))
    for held in (blocks, torch.randint(0, 256, (out, fan_in // weights * size), dtype=torch.uint8)):
        panels = cpu_kernels.to_panels(held, int(qtype), fan_in)
        assert panels.shape == (out, fan_in // weights * panel_size) == (out, cpu_kernels.panel_bytes(int(qtype), fan_in))
        assert not torch.equal(panels[:, :size], held[:, :size])
        into = torch.zeros_like(panels)   # written in place (QuantizedWeight.in_panels: onto huge pages)
        assert torch.equal(cpu_kernels.to_panels(held, int(qtype), fan_in, out=into), panels) and torch.equal(into, panels)
        assert torch.equal(cpu_kernels.from_panels(panels, cpu_kernels.PANEL_TYPES[qtype], fan_in), held)
    weight = QuantizedWeight([(blocks, int(qtype))], fan_in)
    assert torch.equal(weight.in_panels().dequantize(), weight.dequantize())


def test_panels_against_references_at_any_rows(panels):
    """Each type in panels at row counts around the tiles (4) and the GGUF paths' panel threshold (8), fp32
    and bf16, 1 and 2 super-blocks (Q4_0 and Q4_1 also 3 and 18 blocks of 32, SmolLM2's 576), stacked with
    parts that stay in blocks (a Q8_0; a Q4_K of 12 rows) as a Q4_K_M qkv has, against the references."""
    rng = np.random.default_rng(40)
    k_quants = [(16, Q.Q4_K), (8, Q.Q6_K), (9, Q.Q8_0), (12, Q.Q4_K), (24, Q.Q6_K), (8, Q.Q4_1), (16, Q.Q4_0),
                (16, Q.Q5_K), (12, Q.Q5_K)]
    block32 = [(16, Q.Q4_1), (9, Q.Q8_0), (8, Q.Q4_0), (12, Q.Q4_1), (24, Q.Q4_0)]
    for fan_in, kinds in [(256, k_quants), (512, k_quants), (96, block32), (576, block32)]:
        parts = [(random_blocks((out, fan_in), t, rng), t) for out, t in kinds]
        x = torch.from_numpy(rng.standard_normal((max(PANEL_ROWS), fan_in)).astype(np.float32))
        for rows in PANEL_ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                check(x[:rows].to(dtype), parts, panels=True)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K], ids=lambda t: t.name)
def test_panels_give_the_gguf_panels_bits(panels, panel_rows, qtype):
    """From the GGUF paths' panel threshold on, Q4_0, Q4_1, Q4_K and Q5_K in panels sum the same integers in
    the same float order as the panels built per call: the same bits, on 1 and 2 threads; below it (the fused
    kernels there) within fp32 rounding."""
    rng = np.random.default_rng(41)
    blocks = torch.from_numpy(random_blocks((40, 1024), qtype, rng))
    held = cpu_kernels.to_panels(blocks, int(qtype), 1024)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (1, 5, 8, 9, 64, 70):
                x = torch.randn(rows, 1024)
                gguf_y = cpu_kernels.quant_linear(x, [blocks], [int(qtype)])
                panel_y = cpu_kernels.quant_linear(x, [held], [cpu_kernels.PANEL_TYPES[qtype]])
                if rows >= 8:
                    assert torch.equal(panel_y, gguf_y), (n, rows)
                else:
                    scale = x.abs() @ torch.from_numpy(dequantized(blocks.numpy(), qtype)).abs().T
                    assert ((panel_y - gguf_y).abs() <= scale * 1e-5 + 1e-6).all(), (n, rows)
    finally:
        torch.set_num_threads(threads)


def test_q5k_panels_decoded_per_call_or_per_tile_alike(panels):
    """Q5_K in panels: its fifth bits decoded in every tile or the panel decoded once per call (from
    set_quant_q5k_decoded_rows rows) give the same bits, at rows around the tiles, against the blocks'
    per-call panels' bits from 8 rows."""
    rng = np.random.default_rng(45)
    blocks = torch.from_numpy(random_blocks((24, 768), Q.Q5_K, rng))
    held = cpu_kernels.to_panels(blocks, int(Q.Q5_K), 768)
    before = cpu_kernels.set_quant_q5k_decoded_rows(1)
    amx_rows = cpu_kernels.set_quant_amx_rows(2 ** 62)   # the vpdpbusd tiles at every row count
    try:
        for rows in (1, 4, 5, 8, 13, 40):
            x = torch.randn(rows, 768)
            per_call = cpu_kernels.quant_linear(x, [held], [cpu_kernels.PANEL_TYPES[Q.Q5_K]])
            cpu_kernels.set_quant_q5k_decoded_rows(1 << 40)
            per_tile = cpu_kernels.quant_linear(x, [held], [cpu_kernels.PANEL_TYPES[Q.Q5_K]])
            cpu_kernels.set_quant_q5k_decoded_rows(1)
            assert torch.equal(per_call, per_tile), rows
            if rows >= 8:
                assert torch.equal(per_call, cpu_kernels.quant_linear(x, [blocks], [int(Q.Q5_K)])), rows
    finally:
        cpu_kernels.set_quant_q5k_decoded_rows(before)
        cpu_kernels.set_quant_amx_rows(amx_rows)
    assert before == 12


def test_q6k_panels_split_over_threads_alike(panels):
    """Q6_K in panels: 1 and 2 threads give the same bits (each panel's sums are one thread's)."""
    rng = np.random.default_rng(43)
    held = cpu_kernels.to_panels(torch.from_numpy(random_blocks((48, 768), Q.Q6_K, rng)), int(Q.Q6_K), 768)
    x = torch.randn(21, 768)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(cpu_kernels.quant_linear(x, [held], [cpu_kernels.PANEL_TYPES[Q.Q6_K]]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


@pytest.fixture
def amx_rows():
    """Q4_K, Q5_K and Q6_K panels on AMX's int8 tiles (quant_amx.h) where this CPU and build have them; the setting
    (kernels.cpu.set_quant_amx_rows) restored after."""
    if not cpu_kernels.quant_panels() or not cpu_kernels.quant_amx_available():
        pytest.skip("no AMX int8 tiles here (the CPU, the build or Linux's permission)")
    previous = cpu_kernels.set_quant_amx_rows(12)
    yield cpu_kernels.set_quant_amx_rows
    cpu_kernels.set_quant_amx_rows(previous)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_amx_tiles_give_the_vpdpbusd_tiles_bits(amx_rows, qtype):
    """Q4_K, Q5_K and Q6_K panels on AMX tiles (16 rows x 2 panels per product; the K-quants' chunk scales inside
    B, Q6_K's weights signed) sum the same integers as the vpdpbusd tiles and fold them alike: the same bits, for row
    counts around the 16-row tiles, an odd count of panels (a lone last one), 1 to 8 super-blocks, fp32 and
    bf16, 1 and 2 threads; and the default threshold runs them from 12 rows."""
    assert amx_rows(12) == 12
    rng = np.random.default_rng(46 + int(qtype))
    threads = torch.get_num_threads()
    try:
        for out, fan_in in [(8, 256), (24, 768), (40, 2048), (64, 512)]:
            blocks = torch.from_numpy(random_blocks((out, fan_in), qtype, rng))
            held = cpu_kernels.to_panels(blocks, int(qtype), fan_in)
            for rows in (1, 12, 15, 16, 17, 33, 70):
                x = torch.from_numpy(rng.standard_normal((rows, fan_in)).astype(np.float32))
                for dtype, n in [(torch.float32, 1), (torch.bfloat16, 2), (torch.float32, 2)]:
                    torch.set_num_threads(n)
                    amx_rows(1)
                    tiles = cpu_kernels.quant_linear(x.to(dtype), [held], [cpu_kernels.PANEL_TYPES[qtype]])
                    amx_rows(2 ** 62)
                    vnni = cpu_kernels.quant_linear(x.to(dtype), [held], [cpu_kernels.PANEL_TYPES[qtype]])
                    assert torch.equal(tiles, vnni), (out, fan_in, rows, dtype, n)
                    assert tiles.abs().sum() > 0
            amx_rows(1)
            check(torch.from_numpy(rng.standard_normal((17, fan_in)).astype(np.float32)), [(blocks.numpy(), qtype)], panels=True)
    finally:
        torch.set_num_threads(threads)


def test_amx_tiles_beside_other_parts_and_fewer_rows_after_more(amx_rows):
    """A Q4_K_M qkv's parts (Q4_K, Q5_K and Q6_K on the tiles, Q4_1 panels and Q8_0 blocks on their own
    kernels) against the references at a prefill's rows, then a call with fewer rows than the one before
    (the padded row buffers keep the last call's rows: no tile row reads past them into the results)."""
    amx_rows(1)
    rng = np.random.default_rng(47)
    parts = [(random_blocks((out, 512), t, rng), t)
             for out, t in [(24, Q.Q4_K), (8, Q.Q6_K), (16, Q.Q5_K), (9, Q.Q8_0), (8, Q.Q4_1), (40, Q.Q6_K)]]
    x = torch.from_numpy(rng.standard_normal((70, 512)).astype(np.float32))
    for rows in (70, 3, 33, 1, 16):
        check(x[:rows], parts, panels=True)


@pytest.mark.parametrize("qtype", PANEL_KINDS, ids=lambda t: t.name)
def test_rows_of_panels_are_the_blocks_rows(qtype):
    """An embedding table in panels (quant_rows): each row dequantizes to the same bits as from the blocks,
    fp32 and bf16, rows in any order and repeated."""
    rng = np.random.default_rng(44 + int(qtype))
    blocks = torch.from_numpy(random_blocks((32, 512), qtype, rng))
    held = cpu_kernels.to_panels(blocks, int(qtype), 512)
    ids = torch.tensor([31, 0, 7, 8, 8, 15, 16, 23, 24, 3])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(cpu_kernels.quant_rows(held, cpu_kernels.PANEL_TYPES[qtype], ids, 512, dtype),
                           cpu_kernels.quant_rows(blocks, int(qtype), ids, 512, dtype))


def test_panels_refuse_what_they_cannot_hold():
    """Rows not a multiple of 8, in_features not a multiple of the blocks or a type without panels (Q8_0)
    are refused by the repacking; rows not a multiple of 8 by quant_linear and quant_rows; a weight
    with such parts keeps them in blocks."""
    rng = np.random.default_rng(42)
    blocks = torch.from_numpy(random_blocks((12, 256), Q.Q4_K, rng))
    with pytest.raises(RuntimeError, match="multiple of 8 rows"):
        cpu_kernels.to_panels(blocks, int(Q.Q4_K), 256)
    with pytest.raises(RuntimeError, match="not a multiple of the 256"):
        cpu_kernels.to_panels(blocks[:8].contiguous(), int(Q.Q4_K), 128)
    with pytest.raises(RuntimeError, match="not a multiple of the 32"):
        cpu_kernels.to_panels(torch.zeros(8, 36, dtype=torch.uint8), int(Q.Q4_0), 48)
    for kind in (Q.Q8_0,):
        with pytest.raises(RuntimeError, match="has no panels"):
            cpu_kernels.to_panels(blocks[:8].contiguous(), int(kind), 256)
    with pytest.raises(RuntimeError, match="has no panels"):
        cpu_kernels.from_panels(blocks[:8].contiguous(), int(Q.Q4_K), 256)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        cpu_kernels.quant_linear(torch.randn(2, 256), [torch.zeros(12, 148, dtype=torch.uint8)],
                                 [cpu_kernels.PANEL_TYPES[Q.Q4_K]])
    with pytest.raises(RuntimeError, match="multiple of 8"):
        cpu_kernels.quant_rows(torch.zeros(12, 210, dtype=torch.uint8), cpu_kernels.PANEL_TYPES[Q.Q6_K],
                               torch.tensor([0]), 256, torch.float32)
    assert sorted(cpu_kernels.PANEL_TYPES.values()) == cpu_kernels.library().panel_types()
    held = QuantizedWeight([(blocks, int(Q.Q4_K))], 256).in_panels()   # 12 rows: stay in blocks
    assert held.parts[0][1] == int(Q.Q4_K) and held.parts[0][0] is blocks


def test_parts_of_mixed_types_stack_as_columns():
    """qkv of a Q4_K_M file: q and k Q4_K, v Q6_K, one call, columns in order."""
    rng = np.random.default_rng(1)
    parts = [(random_blocks((out, 512), t, rng), t) for out, t in [(24, Q.Q4_K), (8, Q.Q4_K), (9, Q.Q6_K), (5, Q.Q8_0)]]
    for rows in (1, 17):
        check(torch.from_numpy(rng.standard_normal((rows, 512)).astype(np.float32)), parts)


def test_threads_split_columns_alike():
    rng = np.random.default_rng(2)
    blocks = random_blocks((333, 256), Q.Q5_K, rng)
    x = torch.randn(5, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.quant_linear(x, [torch.from_numpy(blocks)], [int(Q.Q5_K)])
        torch.set_num_threads(2)
        two = cpu_kernels.quant_linear(x, [torch.from_numpy(blocks)], [int(Q.Q5_K)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_zero_rows_and_zero_activations():
    rng = np.random.default_rng(3)
    blocks = torch.from_numpy(random_blocks((16, 64), Q.Q4_0, rng))
    assert cpu_kernels.quant_linear(torch.zeros(0, 64), [blocks], [int(Q.Q4_0)]).shape == (0, 16)
    assert torch.equal(cpu_kernels.quant_linear(torch.zeros(2, 64), [blocks], [int(Q.Q4_0)]), torch.zeros(2, 16))


@pytest.mark.parametrize("bad, match", [
    (lambda b: ([b], [int(Q.Q2_K)]), "no quantized kernel"),
    (lambda b: ([b[:, :-1].contiguous()], [int(Q.Q4_0)]), "must be a contiguous uint8"),
    (lambda b: ([b.view(torch.int8)], [int(Q.Q4_0)]), "must be a contiguous uint8"),
    (lambda b: ([b], [int(Q.Q4_0), int(Q.Q4_0)]), "one type per part"),
    (lambda b: ([b], [int(Q.Q4_K)]), "not a multiple"),
])
def test_bad_arguments_are_refused(bad, match):
    blocks = torch.from_numpy(random_blocks((4, 64), Q.Q4_0, np.random.default_rng(4)))
    parts, types = bad(blocks)
    with pytest.raises(RuntimeError, match=match):
        cpu_kernels.quant_linear(torch.randn(2, 64), parts, types)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_quantized_gaussian_weights(qtype):
    """Weights as a model has them (zero mean), quantized; the tests' K-quant quantizer round-trips them."""
    rng = np.random.default_rng(10 + int(qtype))
    w = rng.standard_normal((19, 512)).astype(np.float32)
    blocks = quantize(w, qtype)
    steps = {Q.Q4_0: 0.5, Q.Q4_1: 0.35, Q.Q8_0: 0.02, Q.Q4_K: 0.35, Q.Q5_K: 0.17, Q.Q6_K: 0.1}
    assert np.abs(dequantized(blocks, qtype) - w).max() < steps[qtype]
    check(torch.from_numpy(rng.standard_normal((17, 512)).astype(np.float32)), [(blocks, qtype)])


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_fp32_strategy_is_exact_to_rounding(qtype):
    """set_quant_int8(False): fp32 activations against each column dequantized to fp32, no activation error."""
    rng = np.random.default_rng(20 + int(qtype))
    block = 256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
    blocks = random_blocks((21, 2 * block), qtype, rng)
    w = dequantized(blocks, qtype).astype(np.float64)
    previous = cpu_kernels.set_quant_int8(False)
    try:
        for rows in (1, 6):
            x = torch.from_numpy(rng.standard_normal((rows, 2 * block)).astype(np.float32))
            for dtype in (torch.float32, torch.bfloat16):
                xd = x.to(dtype)
                y = cpu_kernels.quant_linear(xd, [torch.from_numpy(blocks)], [int(qtype)])
                exact = xd.double().numpy() @ w.T
                tol = np.abs(xd.double().numpy()) @ np.abs(w).T * 1e-5 + 1e-6
                if dtype == torch.bfloat16:
                    tol += np.abs(exact) * 2.0 ** -8
                assert_within(y, exact, tol, f"fp32 strategy, {rows} rows, {dtype}")
    finally:
        cpu_kernels.set_quant_int8(previous)
    assert cpu_kernels.set_quant_int8(previous) == previous


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_dequantized_by_index(qtype):
    """quant_rows (an embedding table kept in blocks): the gathered rows as gguf.quants dequantizes them,
    exactly for Q4_0, Q8_0 and Q6_K (one rounding either way), within one fp32 rounding for the
    d q + m types; repeated and unordered indices; bf16 as the fp32 rows rounded."""
    rng = np.random.default_rng(10 + int(qtype))
    block = 256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
    rows, fan_in = 29, 2 * block
    blocks = random_blocks((rows, fan_in), qtype, rng)
    table = torch.from_numpy(dequantized(blocks, qtype))
    exact = qtype in (Q.Q4_0, Q.Q8_0, Q.Q6_K)
    for ids in ([0], [28, 3, 3, 0, 17], list(rng.integers(0, rows, 300)), []):
        index = torch.tensor(ids, dtype=torch.int64)
        got = cpu_kernels.quant_rows(torch.from_numpy(blocks), int(qtype), index, fan_in, torch.float32)
        assert got.shape == (len(ids), fan_in)
        want = table[index]
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=2.0 ** -23, atol=1e-30)
        got16 = cpu_kernels.quant_rows(torch.from_numpy(blocks), int(qtype), index, fan_in, torch.bfloat16)
        assert got16.dtype == torch.bfloat16 and torch.equal(got16, got.bfloat16())


def test_rows_out_of_range_raise():
    rng = np.random.default_rng(11)
    blocks = torch.from_numpy(random_blocks((7, 64), Q.Q8_0, rng))
    for ids in ([7], [-1], [0, 3, 2 ** 40], [6, -7]):
        with pytest.raises(RuntimeError, match="out of range for 7 rows"):
            cpu_kernels.quant_rows(blocks, int(Q.Q8_0), torch.tensor(ids), 64, torch.float32)
    with pytest.raises(RuntimeError, match="blocks must be a contiguous uint8"):   # the wrong width for the type
        cpu_kernels.quant_rows(blocks, int(Q.Q4_0), torch.tensor([0]), 64, torch.float32)


FUSED_ROWS = [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.fixture
def fused_rows():
    """Sets quant_linear's fused-kernel threshold for a test (kernels.cpu.set_quant_fused_rows), restored after;
    yields the setter and the default."""
    default = cpu_kernels.set_quant_fused_rows(0)
    cpu_kernels.set_quant_fused_rows(default)
    yield cpu_kernels.set_quant_fused_rows, default
    cpu_kernels.set_quant_fused_rows(default)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_fused_kernels_against_references_and_columns(qtype, fused_rows):
    """The few-row kernels (each block decoded in registers), forced at 1..8 rows (Q4_0 / Q4_1 run them up to
    4) and odd output counts, K/32 = 5 for the 32-weight blocks (one block past the offsets' 8 lanes): against
    the float64 references,
    and the same bits as the decode-once columns (same products, same order of fp32 sums) at a decode
    step's rows (below 8, where other paths may take over); on 1 and 2 threads alike."""
    set_fused, default = fused_rows
    rng = np.random.default_rng(40 + int(qtype))
    block = 256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
    threads = torch.get_num_threads()
    try:
        for fan_in, out in ((5 * block, 37), (2 * block, 1), (block, 9)):
            blocks = [torch.from_numpy(random_blocks((out, fan_in), qtype, rng))]
            x = torch.from_numpy(rng.standard_normal((max(FUSED_ROWS + [default]) + 1, fan_in)).astype(np.float32))
            for rows in FUSED_ROWS:
                for dtype in (torch.float32, torch.bfloat16):
                    xd = x[:rows].to(dtype)
                    set_fused(max(FUSED_ROWS))
                    check(xd, [(blocks[0].numpy(), qtype)])
                    fused = cpu_kernels.quant_linear(xd, blocks, [int(qtype)])
                    torch.set_num_threads(1)
                    assert torch.equal(cpu_kernels.quant_linear(xd, blocks, [int(qtype)]), fused)
                    torch.set_num_threads(2)
                    set_fused(0)
                    if rows < 8:
                        assert torch.equal(cpu_kernels.quant_linear(xd, blocks, [int(qtype)]), fused), (rows, dtype)
            set_fused(default)   # either side of the default switch
            for rows in (default, default + 1):
                check(x[:rows], [(blocks[0].numpy(), qtype)])
    finally:
        torch.set_num_threads(threads)


def test_int8_peak_script_prints_each_instructions_rate():
    """scripts/bench_int8_peak.py (the ceiling bench_quant.py's rates are read against) builds and prints
    a positive rate per instruction, on one core and together, and says so where VNNI is missing."""
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    if shutil.which("g++") is None or " avx2" not in flags or " fma" not in flags:
        pytest.skip("needs g++ and an x86 CPU with AVX2 and FMA")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "bench_int8_peak.py"), "--seconds", "0.02",
                          "--threads", "2"], capture_output=True, text=True, check=True, timeout=120).stdout
    rates = dict((name.strip(), (float(one), float(both))) for name, one, both in re.findall(
        r"^(.+?)\s+([\d.]+) G multiply-adds/s on one core,\s+([\d.]+) on 2 threads", out, re.M))
    assert {"maddubs+add (int8, AVX2)", "fp32 FMA (8 lanes)"} <= rates.keys(), out
    assert all(one > 0 and both > 0 for one, both in rates.values()), out
    vnni = " avx_vnni" in flags or (" avx512_vnni" in flags and " avx512vl" in flags)
    assert ("vpdpbusd (int8, VNNI)" in rates) == vnni, out


def test_bench_quant_times_another_checkouts_kernels_beside_these():
    """scripts/bench_quant.py --against CHECKOUT builds that checkout's kernels under another extension name
    (here: this checkout's again), loads them beside this process's own as a distinct module, and times each
    variant of them right after this build's, each with a time."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    types = "Q4_K,Q4_K_PANELS" if cpu_kernels.quant_panels() else "Q4_K,Q8_0"
    out = subprocess.run([sys.executable, str(root / "scripts" / "bench_quant.py"), "--shapes", "64x512", "--rows", "1,5",
                          "--types", types, "--dtypes", "float32", "--rounds", "1", "--seconds", "0.01",
                          "--against", str(root)], capture_output=True, text=True, check=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(root)}).stdout
    times = re.findall(r"(\S+) ([\d.]+) ms [\d.]+ GFLOP/s", out)
    names = [name for name, _ in times]
    for rows in (1, 5):
        assert f"64x512 float32 rows {rows}:" in out, out
    for name in types.split(","):
        assert names.count(name) == 2 and names.count(f"{name}@{root.name}") == 2, out
        assert names.index(f"{name}@{root.name}") == names.index(name) + 1, out   # interleaved: right after
    assert all(float(ms) > 0 for _, ms in times), out   # (a rate prints 0.0 when a loaded box stalls a call)
