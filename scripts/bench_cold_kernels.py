"""Decode attention and LoRA kernels over data that comes from DRAM, as in a decode step.

A step streams all weights between two layers' attention calls, so each layer's KV rows and each
adapter's rows are cold when the kernel reads them; a kernel that runs one layer again and again
measures its arithmetic on cached data instead. Here each call reads another of 30 layers, the
pages and adapter rows scattered over pools larger than the caches, and a 256 MB write before
each pass of 30 evicts what the pass before left:

    .venv/bin/python scripts/bench_cold_kernels.py                   # SmolLM2's shapes, W1's ranks
    .venv/bin/python scripts/bench_cold_kernels.py --decodes 4 --context 512

attention: kernels.cpu.paged_decode_attention, --decodes sequences of --context rows each (9 query
heads, 3 KV heads, head_dim 64, block 16). LoRA: kernels.cpu.lora_segments for the qkv and o groups
of 4 adapters (ranks 8/16/8/16 on q, k, v, o, as W1), one run of --decodes/4 tokens each, at 1 and
2 threads. Prints the median ms per pass of 30 layers.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import kernels.cpu as cpu_kernels  # noqa: E402

LAYERS, BLOCK, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 30, 16, 9, 3, 64, 576


def timed_passes(one_pass, repeats: int) -> float:
    """Median seconds of one_pass() with the caches flushed before each."""
    flush = torch.empty(64 << 20, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        flush.add_(1.0)
        t0 = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_attention(args, g: torch.Generator) -> None:
    n, ctx = args.decodes, args.context
    pages_per = -(-ctx // BLOCK)
    pages = max(2000, 2 * n * pages_per)          # pages of 368 KB: the pool far larger than L3
    kv = torch.randn(pages, 2, LAYERS, BLOCK, KV_HEADS * HEAD_DIM, generator=g).bfloat16()
    tables = torch.randperm(pages, generator=g)[:n * pages_per].view(n, pages_per).contiguous()
    lens = torch.full((n,), ctx, dtype=torch.int64)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g).bfloat16()
    out = torch.empty_like(q)

    def one_pass():
        for layer in range(LAYERS):
            cpu_kernels.paged_decode_attention(out, q, kv[:, 0, layer], kv[:, 1, layer], tables, lens,
                                               HEAD_DIM ** -0.5)
    one_pass()
    kv_mb = n * ctx * 2 * KV_HEADS * HEAD_DIM * 2 * LAYERS / 2**20
    print(f"decode attention, {n} x {ctx} rows ({kv_mb:.0f} MB of K and V): "
          f"{timed_passes(one_pass, args.repeats) * 1e3:.2f} ms per 30 layers")


def bench_lora(args, g: torch.Generator) -> None:
    ranks = torch.tensor([[r] * 4 + [0] * 3 for r in (8, 16, 8, 16)], dtype=torch.int32)   # q, k, v, o
    fan_out = (HIDDEN, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, HIDDEN)
    flat = torch.randn(150 << 20, generator=g).bfloat16()                                  # 300 MB pool
    a_ptr = torch.zeros(4, LAYERS, 7, 16, dtype=torch.int64)
    b_ptr = torch.zeros_like(a_ptr)
    scaling = torch.full((4, LAYERS, 7), 2.0)
    for a in range(4):
        for layer in range(LAYERS):            # each adapter's layer somewhere else, its rows in order
            row = int(torch.randint(0, flat.numel() - (1 << 20), (1,), generator=g))
            for p in range(4):
                for j in range(int(ranks[a, p])):
                    a_ptr[a, layer, p, j], row = row, row + HIDDEN
                for j in range(int(ranks[a, p])):
                    b_ptr[a, layer, p, j], row = row, row + fan_out[p]
    qkv = torch.tensor([[0, 0, HIDDEN], [1, HIDDEN, fan_out[1]], [2, HIDDEN + fan_out[1], fan_out[2]]])
    o = torch.tensor([[3, 0, HIDDEN]])
    tokens = args.decodes
    runs = torch.tensor([[i * tokens // 4, (i + 1) * tokens // 4, i] for i in range(4)])
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    y_qkv, y_o = torch.zeros(tokens, HIDDEN + 2 * fan_out[1]).bfloat16(), torch.zeros(tokens, HIDDEN).bfloat16()

    def one_pass():
        for layer in range(LAYERS):
            cpu_kernels.lora_segments(y_qkv, x, flat, runs, ranks, a_ptr, b_ptr, scaling, layer, qkv)
            cpu_kernels.lora_segments(y_o, x, flat, runs, ranks, a_ptr, b_ptr, scaling, layer, o)
    threads = torch.get_num_threads()
    for t in (1, 2):
        torch.set_num_threads(t)
        one_pass()
        print(f"LoRA qkv + o, {tokens} tokens of 4 adapters, {t} thread(s): "
              f"{timed_passes(one_pass, args.repeats) * 1e3:.2f} ms per 30 layers")
    torch.set_num_threads(threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decodes", type=int, default=16)
    p.add_argument("--context", type=int, default=120)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_kernels.library() is None:
        sys.exit(f"native kernels unavailable: {cpu_kernels.error()}")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"# {cpu}, {args.threads} threads, bf16, load average before {Path('/proc/loadavg').read_text().split()[0]}")
    g = torch.Generator().manual_seed(0)
    bench_attention(args, g)
    bench_lora(args, g)


if __name__ == "__main__":
    main()
