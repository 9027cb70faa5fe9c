"""Native CPU kernels (kernels/cpu) against the eager torch ops they replace in model/llama.py.

    .venv/bin/python scripts/bench_native.py                        # SmolLM2-135M's shapes, bf16, 2 threads
    .venv/bin/python scripts/bench_native.py --dtype float32 --batch 1 --context 2048
    .venv/bin/python scripts/bench_native.py --chunk 32 --chunk-start 480     # a prompt's last chunk

One layer's call of each, for a decode step of --batch sequences whose contexts are drawn around
--context (SmolLM2-135M by default: 9 query heads, 3 KV heads, head_dim 64, hidden 576, 30 layers,
block 16, so KV rows are strided as in the pool):

    decode attention   eager: plan_attention's bmm's (bf16) or SDPA (fp32) over gathered pages
                       native: paged_decode_attention over the block tables
    prefill attention  one prefill chunk of --chunk rows at positions --chunk-start.. (its earlier
                       rows cached): llama.attention, eager (gathered pages, a causal mask) or native
                       (paged_prefill_attention over the block table)
    add + RMSNorm      eager: h + delta, F.rms_norm          native: add_rms_norm
    RoPE + KV write    eager: apply_rope, index_copy_        native: rope_write_kv

and W1's LoRA (its four adapters from --bench-dir, ranks 8/16/8/16 on q, k, v, o, on SmolLM2's
weights), one layer's group projection with its LoRA for a decode step of --batch sequences (runs
of --batch/4 per adapter, grouped as the runner groups them) and a prefill step of 4 x --prefill
tokens:

    LoRA qkv / o       eager: TorchLoraBackend.project as it runs once a set has lasted (stacks
                       packed for oneDNN, shrink fused into the base GEMM, mask, expand, add), or
                       the per-adapter loop where its cost model picks it
                       native: the base GEMM + lora_segments from the pool rows
                       base: the base GEMM alone, i.e. what either spends beyond it is LoRA's

--gemm instead times the base projections of a decode step (SmolLM2's qkv, o, gate_up, down and
lm_head shapes) at --gemm-rows rows, oneDNN's reordered GEMM (OneDnnLinear) against the native
packed one (NativeLinear, kernels/cpu/gemm.h): in bf16 on CPUs with AVX512-BF16, its vdpbf16ps tiles
at every row count and, where the CPU has AMX, its AMX tiles; in float32 (--dtype float32) on AVX2
CPUs without AVX-512, its FMA tiles. Each call runs on the next of enough weight copies
(--gemm-stream-mb in all) that the weights stream from DRAM as in a step:

    .venv/bin/python scripts/bench_native.py --gemm [--dtype float32]

--lora-cold instead times lora_segments over every layer of a step whose adapters' rows come from
DRAM, as with 1,000 adapters in turn (#14): --cold-adapters random PEFT-like adapters of ranks 8 and
16 on q and v laid out as the pager lays them, a decode step of 31 sequences of distinct adapters,
and a mixed step of those decodes and one adapter's --prefill-run prompt tokens; a 400 MB write
between calls evicts the caches:

    .venv/bin/python scripts/bench_native.py --lora-cold

Prints the median microseconds per call over --repeats calls and the per-step total (x layers);
with --cpu-clock (for --threads 1 on a loaded box) of the thread's CPU time, not the wall.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import kernels.cpu as cpu_kernels  # noqa: E402
from asyncserve.lora.backend import TorchLoraBackend  # noqa: E402
from asyncserve.lora.batch import LoraBatch  # noqa: E402
from asyncserve.model.llama import (PrefillChunk, StepInputs, _decode_attention, apply_rope, attention,  # noqa: E402
                                    plan_attention)


def median_us(fn, repeats: int, clock=time.perf_counter) -> float:
    for _ in range(max(3, repeats // 10)):
        fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e6


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=256, help="mean context; lengths drawn in [context/2, 3 context/2]")
    p.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("NH", "NKV", "HD"))
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--cpu-clock", action="store_true", help="time the thread's CPU (time.thread_time), not the wall")
    p.add_argument("--chunk", type=int, default=240, help="prefill chunk rows (240: the 256-token budget beside 16 decodes)")
    p.add_argument("--chunk-start", type=int, default=240, help="the chunk's first position: rows cached before it")
    p.add_argument("--bench-dir", type=Path, default=REPO / ".bench",
                   help="the folder holding w1/, for W1's adapters (default: .bench, where scripts/make_w1.py writes it)")
    p.add_argument("--prefill", type=int, default=64, help="prompt tokens per adapter in the LoRA prefill step")
    p.add_argument("--gemm", action="store_true", help="time the base projections instead (see above)")
    p.add_argument("--gemm-rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 256])
    p.add_argument("--gemm-stream-mb", type=int, default=256, help="weight copies per shape, MB in all")
    p.add_argument("--lora-cold", action="store_true", help="time LoRA with its rows in DRAM instead (see above)")
    p.add_argument("--cold-adapters", type=int, default=1000)
    p.add_argument("--prefill-run", type=int, default=224, help="the mixed step's prompt tokens of one adapter")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if cpu_kernels.library() is None:
        sys.exit(f"native kernels unavailable: {cpu_kernels.error()}")
    if args.gemm:
        return bench_gemm(args, dtype)
    if args.lora_cold:
        return bench_lora_cold(args, dtype)
    g = torch.Generator().manual_seed(0)
    nh, nkv, hd = args.heads
    n, block, layers, kv_size = args.batch, args.block, args.layers, nkv * hd

    # the pool as the model sees it, with each sequence's pages scattered over it
    lens = torch.randint(max(1, args.context // 2), args.context * 3 // 2 + 1, (n,), generator=g)
    width = int(-(-lens.max() // block))
    pages = n * width + 1
    kv = torch.randn(pages, 2, layers, block, kv_size, generator=g).to(dtype)
    tables = torch.randperm(pages, generator=g)[:n * width].view(n, width)
    positions = lens - 1
    mask = (torch.arange(width * block)[None, :] < lens[:, None])[:, None, None, :]
    inp = StepInputs(input_ids=torch.zeros(n, dtype=torch.int64), positions=positions,
                     write_rows=tables[:, 0] * (2 * layers * block), num_decode=n,
                     decode_pages=tables.flatten(), decode_mask=mask,
                     decode_padding=(~mask).view(-1).nonzero().squeeze(1), prefills=[],
                     sample_index=torch.arange(n))
    eager_plan = plan_attention(inp, nh, nkv, hd, dtype)
    native_plan = plan_attention(inp, nh, nkv, hd, dtype, native=True)
    q = torch.randn(n, nh, hd, generator=g).to(dtype)
    k_cache, v_cache = kv[:, 0, 3], kv[:, 1, 3]

    # one prefill chunk, its sequence's pages scattered over a pool of its own
    chunk_rows, ctx = args.chunk, args.chunk_start + args.chunk
    chunk_pages = -(-ctx // block)
    chunk_kv = torch.randn(chunk_pages + 1, 2, layers, block, kv_size, generator=g).to(dtype)
    chunk_table = torch.randperm(chunk_pages + 1, generator=g)[:chunk_pages]
    chunk_positions = torch.arange(args.chunk_start, ctx)
    chunk_inp = StepInputs(input_ids=torch.zeros(chunk_rows, dtype=torch.int64), positions=chunk_positions,
                           write_rows=chunk_table[chunk_positions // block] * (2 * layers * block) + chunk_positions % block,
                           num_decode=0, decode_pages=torch.zeros(0, dtype=torch.int64),
                           decode_mask=torch.zeros(0, 1, 1, block, dtype=torch.bool),
                           decode_padding=torch.zeros(0, dtype=torch.int64),
                           prefills=[PrefillChunk(0, chunk_rows, args.chunk_start, chunk_table)],
                           sample_index=torch.tensor([chunk_rows - 1]))
    chunk_plans = [plan_attention(chunk_inp, nh, nkv, hd, dtype, native=native) for native in (False, True)]
    chunk_q = torch.randn(chunk_rows, nh, hd, generator=g).to(dtype)
    chunk_k = chunk_kv[:, 0, 3][chunk_table].view(-1, nkv, hd)[args.chunk_start:ctx]   # the chunk's own, as written
    chunk_v = chunk_kv[:, 1, 3][chunk_table].view(-1, nkv, hd)[args.chunk_start:ctx]

    def prefill(plan):
        return attention(chunk_q, chunk_k, chunk_v, chunk_kv[:, 0, 3], chunk_kv[:, 1, 3], chunk_inp, plan)

    h = torch.randn(n, args.hidden, generator=g).to(dtype)
    delta = torch.randn(n, args.hidden, generator=g).to(dtype)
    weight = torch.randn(args.hidden, generator=g).to(dtype)

    qkv = torch.randn(n, (nh + 2 * nkv) * hd, generator=g).to(dtype)
    angles = torch.outer(torch.arange(4096, dtype=torch.float32), torch.rand(hd // 2, generator=g))
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    kv_rows = kv.view(-1, kv_size)
    rows = inp.write_rows + 3 * block
    layer_rows = torch.cat([rows, rows + layers * block])
    q_size = nh * hd

    def eager_rope():
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]   # forward() does this once per step
        qk = apply_rope(qkv[:, :q_size + kv_size].view(n, nh + nkv, hd), c, s)
        kv_rows.index_copy_(0, layer_rows, torch.cat([qk[:, nh:].reshape(n, kv_size), qkv[:, q_size + kv_size:]]))

    cases = {
        "decode attention": (
            lambda: _decode_attention(q, k_cache, v_cache, eager_plan),
            lambda: _decode_attention(q, k_cache, v_cache, native_plan)),
        "prefill attention": (lambda: prefill(chunk_plans[0]), lambda: prefill(chunk_plans[1])),
        "add + RMSNorm": (
            lambda: F.rms_norm(h + delta, (args.hidden,), weight, 1e-5),
            lambda: cpu_kernels.add_rms_norm(h.clone(), delta, weight, 1e-5)),   # clone: like eager's new h
        "RoPE + KV write": (
            eager_rope,
            lambda: cpu_kernels.rope_write_kv(qkv, positions, cos, sin, kv_rows, inp.write_rows, 3 * block,
                                              (layers + 3) * block, nh, nkv)),
    }
    torch.testing.assert_close(_decode_attention(q, k_cache, v_cache, native_plan).float(),
                               _decode_attention(q, k_cache, v_cache, eager_plan).float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(prefill(chunk_plans[1]).float(), prefill(chunk_plans[0]).float(), atol=2e-2, rtol=0)
    print(f"# {cpu_name()}, {args.threads} threads, {args.dtype}, {n} decodes, contexts {int(lens.min())}-"
          f"{int(lens.max())} (mean {float(lens.float().mean()):.0f}), prefill chunk {chunk_rows}@{args.chunk_start}, heads {nh}/{nkv}x{hd}, "
          f"hidden {args.hidden}")
    print(f"{'kernel':<18} {'eager us':>9} {'native us':>10} {'speedup':>8} {'eager ms/step':>14} {'native ms/step':>15}")
    per_layer = {"decode attention": 1, "prefill attention": 1, "add + RMSNorm": 2, "RoPE + KV write": 1}
    for name, (eager, native) in cases.items():
        clock = time.thread_time if args.cpu_clock else time.perf_counter
        e, nt = median_us(eager, args.repeats, clock), median_us(native, args.repeats, clock)
        k = per_layer[name] * layers
        print(f"{name:<18} {e:9.1f} {nt:10.1f} {e / nt:7.1f}x {e * k / 1e3:14.2f} {nt * k / 1e3:15.2f}")
    bench_lora(args, dtype)


def bench_lora_cold(args, dtype: torch.dtype) -> None:
    """lora_segments over --layers layers of q and v for steps of adapters whose rows are cold."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    hidden, (_, nkv, hd), layers, count = args.hidden, args.heads, args.layers, args.cold_adapters
    fan_out = (hidden, nkv * hd)                                    # q, v
    ranks = np.array([[8, 8] if i % 2 else [16, 16] for i in range(count)], dtype=np.int32)
    max_rank = int(ranks.max())
    # per adapter, per layer, per projection: its A rows, then its B^T rows (pager/pool.py)
    a_ptr = np.zeros((count, layers, 2, max_rank), dtype=np.int64)
    b_ptr = np.zeros_like(a_ptr)
    offset = 0
    for i in range(count):
        for layer in range(layers):
            for p, out in enumerate(fan_out):
                r = int(ranks[i, p])
                a_ptr[i, layer, p, :r] = offset + np.arange(r) * hidden
                offset += r * hidden
                b_ptr[i, layer, p, :r] = offset + np.arange(r) * out
                offset += r * out
    flat = (torch.randn(offset, generator=g) * 0.01).to(dtype)
    tables = (torch.from_numpy(ranks), torch.from_numpy(a_ptr), torch.from_numpy(b_ptr),
              torch.full((count, layers, 2), 2.0))
    projections = torch.tensor([[0, 0, fan_out[0]], [1, fan_out[0], fan_out[1]]], dtype=torch.int64)
    evict = torch.empty(100 * 2**20)                               # 400 MB
    decodes = 31
    print(f"# {cpu_name()}, {args.threads} threads, {args.dtype}, {count} adapters of ranks 8/16 on q and v, "
          f"{flat.numel() * flat.element_size() / 2**30:.2f} GiB of rows; caches evicted before each call")
    print(f"{'step':<28} {'tokens':>6} {'MB of rows':>10} {'ms/step':>8}")
    for name, prefill in (("decode: 31 adapters", 0), (f"mixed: 31 + 1 x {args.prefill_run}", args.prefill_run)):
        times, nbytes = [], 0
        for _ in range(max(5, args.repeats // 30)):
            ids = torch.randperm(count, generator=g)[:decodes + (1 if prefill else 0)].tolist()
            runs = [[t, t + 1, ids[t]] for t in range(decodes)] + ([[decodes, decodes + prefill, ids[-1]]] if prefill else [])
            tokens = decodes + prefill
            x = torch.randn(tokens, hidden, generator=g).to(dtype)
            y = torch.zeros(tokens, sum(fan_out), dtype=dtype)
            run_table = torch.tensor(runs, dtype=torch.int64)
            evict.add_(1.0)
            t0 = time.perf_counter()
            for layer in range(layers):
                cpu_kernels.lora_segments(y, x, flat, run_table, *tables, layer, projections)
            times.append(time.perf_counter() - t0)
            nbytes = int(sum(ranks[i] @ np.array([hidden + fan_out[0], hidden + fan_out[1]]) for i in ids)) * layers * flat.element_size()
        print(f"{name:<28} {tokens:6d} {nbytes / 1e6:10.1f} {statistics.median(times) * 1e3:8.2f}")


def bench_gemm(args, dtype: torch.dtype) -> None:
    """oneDNN's reordered GEMM against the native packed one (bf16: its vdpbf16ps tiles, and its AMX
    tiles where the CPU has them; float32: its AVX2 FMA tiles), weights streamed from DRAM."""
    from asyncserve.model.linear import NativeLinear, OneDnnLinear

    if dtype == torch.bfloat16 and not cpu_kernels.bf16_gemm_available():
        sys.exit("the native bf16 GEMM needs AVX512-BF16 (and ASYNCSERVE_NATIVE unset)")
    if dtype == torch.float32 and not cpu_kernels.fp32_gemm_available():
        sys.exit("the native float32 GEMM needs AVX2 and FMA without AVX-512 (and ASYNCSERVE_NATIVE unset)")
    hidden = args.hidden
    shapes = {"qkv": (hidden, 960), "o": (hidden, hidden), "gate_up": (hidden, 3072), "down": (1536, hidden),
              "lm_head": (hidden, 49152)}
    # the native kinds, by whether AMX tiles may run
    if dtype == torch.float32:
        native_kinds = {"avx2": False}
    else:
        native_kinds = {"vdpbf16ps": False, **({"amx": True} if cpu_kernels.amx_gemm_available() else {})}
    g = torch.Generator().manual_seed(0)
    print(f"# {cpu_name()}, {args.threads} threads, {args.dtype}, weights rotated over {args.gemm_stream_mb} MB per shape")
    print(f"{'projection':<10} {'rows':>5} {'oneDNN us':>10} {'GFLOP/s':>8}"
          + "".join(f" {kind + ' us':>13} {'GFLOP/s':>8} {'speedup':>8}" for kind in native_kinds))
    previous = cpu_kernels.set_amx_gemm(False)
    try:
        for name, (k, n) in shapes.items():
            copies = max(2, args.gemm_stream_mb * 2**20 // (dtype.itemsize * k * n))
            weights = [torch.randn(n, k, generator=g).to(dtype) for _ in range(copies)]
            linears = {"onednn": [OneDnnLinear(w) for w in weights], "native": [NativeLinear(w) for w in weights]}
            del weights
            for rows in args.gemm_rows:
                x = torch.randn(rows, k, generator=g).to(dtype)
                times = {}
                for kind, amx in {"onednn": False, **native_kinds}.items():
                    lins = linears["onednn" if kind == "onednn" else "native"]
                    cpu_kernels.set_amx_gemm(amx)
                    turn = iter(range(1 << 62))
                    times[kind] = median_us(lambda: lins[next(turn) % copies](x), args.repeats)
                flops = 2 * rows * k * n / 1e3           # per us -> GFLOP/s
                print(f"{name:<10} {rows:>5} {times['onednn']:10.1f} {flops / times['onednn']:8.1f}"
                      + "".join(f" {times[kind]:13.1f} {flops / times[kind]:8.1f} "
                                f"{times['onednn'] / times[kind]:7.2f}x" for kind in native_kinds))
            del linears
    finally:
        cpu_kernels.set_amx_gemm(previous)


def bench_lora(args, dtype: torch.dtype) -> None:
    """W1's LoRA on one layer's qkv and o groups: eager backend against native, with the base GEMM."""
    from asyncserve import LLM

    from workloads import w1_file

    folder = w1_file(args.bench_dir, "adapters")
    paths = {p.name: str(p) for p in sorted(folder.iterdir())}
    llm = LLM(adapters=paths, dtype=args.dtype, device="cpu", threads=args.threads, pool_mem=256 * 2**20)
    engine = llm.engine
    adapters = [engine.pager.ensure_resident(name) for name in paths]
    engine.pager.write_pending()
    eager = TorchLoraBackend(engine.pool, engine.model_config, pack_after_steps=1)
    eager.native = False
    native = TorchLoraBackend(engine.pool, engine.model_config)
    if not native.native:
        sys.exit("the backend does not run the native LoRA here")
    layer = engine.runner.weights.layers[3]
    g = torch.Generator().manual_seed(1)
    steps = {"decode": [args.batch // len(adapters)] * len(adapters), "prefill": [args.prefill] * len(adapters)}
    print(f"# W1 LoRA, {len(adapters)} adapters, layer 3; eager = packed stacks, shrink fused into the base GEMM")
    print(f"{'kernel':<18} {'eager us':>9} {'native us':>10} {'speedup':>8} {'base us':>8} "
          f"{'LoRA eager':>11} {'LoRA native':>12} (us beyond the base GEMM)")
    for step, lengths in steps.items():
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        batch = LoraBatch(adapters, starts, list(range(len(adapters))), starts[-1], engine.pool.device,
                          num_decode=starts[-1] if step == "decode" else 0)
        for _ in range(2):                      # the first step builds the stacks, the second packs and fuses
            eager.begin_step(batch)
        native.begin_step(batch)
        for group in ("qkv", "o"):
            base = getattr(layer, group)
            x = torch.randn(starts[-1], base.in_features, generator=g).to(dtype)
            torch.testing.assert_close(native.project(3, group, x, base).float(), eager.project(3, group, x, base).float(),
                                       atol=3e-2, rtol=3e-2)
            e = median_us(lambda: eager.project(3, group, x, base), args.repeats)
            nt = median_us(lambda: native.project(3, group, x, base), args.repeats)
            b = median_us(lambda: base(x), args.repeats)
            plan = eager._plans[group][0]
            print(f"{'LoRA ' + group + ' ' + step:<18} {e:9.1f} {nt:10.1f} {e / nt:7.1f}x {b:8.1f} {e - b:11.1f} "
                  f"{nt - b:12.1f}  ({step}: {starts[-1]} tokens, eager plan {plan})")


if __name__ == "__main__":
    main()
