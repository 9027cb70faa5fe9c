"""Times kernels.cpu.quant_linear (GGUF blocks; int8 activations, and with --strategies int8,columns,fp32 also
the int8 path a column at a time at every row count (no panels) and the fp32 strategy: each column
dequantized to fp32, fp32 activations) against the dense projection this CPU
runs for the same shape (model/linear.py's make_linear: the native bf16 GEMM on AVX512-BF16 CPUs, oneDNN's
reordered GEMM elsewhere), in fp32 and bf16 activations, at a step's row counts.

Runs are interleaved (each round times every variant once, the median round is reported) and the load
average is printed before and after, since boxes are shared. Weights are random blocks (every bit
random, the fp16 scales set to keep entries ~0.05): the kernels' speed does not depend on the values.

    PYTHONPATH=. python scripts/bench_quant.py [--shapes 2048x2048,8192x2048] [--rows 1,16,64] [--rounds 7] [--threads N]
        [--types Q4_K,Q5_K,Q4_K_PANELS,Q6_K_PANELS] [--strategies int8,columns,fp32] [--against ../other]

PYTHONPATH picks the kernels. --against CHECKOUT also times that checkout's kernels (its ops.cpp built under
another extension name, once per checkout: ~1.5 min) in the same process, each variant of them
("Q4_K_PANELS@other") right after this build's, on the same inputs: the way to compare two versions of
quant.h on a box whose speed drifts between processes by more than what a change gains.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch

import kernels.cpu as cpu_kernels
from asyncserve.model.linear import make_linear
from kernel_builds import other_build

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# byte offsets of each type's fp16 scales (d, and dmin or m where it has one)
SCALES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(out: int, fan_in: int, qtype: Q, rng: np.random.Generator) -> torch.Tensor:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(out * fan_in // block, size), dtype=np.uint8)
    for offset in SCALES[qtype]:
        blocks[:, offset:offset + 2] = np.full((len(blocks), 1), 1e-3, np.float16).view(np.uint8)
    return torch.from_numpy(blocks.reshape(out, -1))


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def timed(fn, seconds: float) -> float:
    """Mean seconds per call over at least `seconds` of calls (after one warm call)."""
    fn()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or n < 3:
        fn()
        n += 1
    return elapsed / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2048x2048,8192x2048", help="OUTxIN pairs")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.2, help="per variant per round")
    ap.add_argument("--types", default=",".join(t.name for t in TYPES),
                    help="ggml types to time; Q4_K_PANELS, Q6_K_PANELS: those repacked into panels of 8 columns, as "
                         "QuantLinear holds them on builds that run panels")
    ap.add_argument("--strategies", default="int8",
                    help="int8 (as served), vnni (panels without AMX tiles: set_quant_amx_rows), columns (int8 "
                         "without panels: set_quant_panel_rows) and/or fp32 (kernels.cpu.set_quant_int8)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--against", type=Path, default=None,
                    help="another checkout whose kernels are timed beside these, interleaved in this process")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_kernels.library() is None:
        raise SystemExit(f"native kernels unavailable: {cpu_kernels.error()}")
    print(f"CPU: {cpu_name()}; threads {torch.get_num_threads()}; quant path {cpu_kernels.quant_path()}; "
          f"panels {cpu_kernels.quant_panels()}; bf16 GEMM {cpu_kernels.bf16_gemm_available()}; load average {os.getloadavg()}")
    panel_rows = cpu_kernels.set_quant_panel_rows(8)   # reads the settings, restored below
    cpu_kernels.set_quant_panel_rows(panel_rows)
    amx_rows = cpu_kernels.set_quant_amx_rows(8)
    cpu_kernels.set_quant_amx_rows(amx_rows)
    print(f"AMX tiles for Q4_K / Q5_K / Q6_K panels: {cpu_kernels.quant_amx_available()} (from {amx_rows} rows)")
    libraries = {"": cpu_kernels.library()}   # variant suffix -> kernels
    if args.against:
        libraries[f"@{args.against.resolve().name}"] = other_build(args.against)
        print(f"against {args.against.resolve()}: each variant of its kernels right after this build's")
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        out, fan_in = (int(v) for v in shape.split("x"))
        blocks = {}   # name -> (kernels, type id, blocks): each build's panels in its own layout
        for name in args.types.split(","):
            qtype = Q[name.removesuffix("_PANELS")]
            gguf_blocks = random_blocks(out, fan_in, qtype, rng)
            for suffix, lib in libraries.items():
                if name.endswith("_PANELS"):
                    blocks[name + suffix] = (lib, cpu_kernels.PANEL_TYPES[qtype], lib.panels(gguf_blocks, qtype, fan_in, True))
                else:
                    blocks[name + suffix] = (lib, int(qtype), gguf_blocks)
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            dense = make_linear(torch.randn(out, fan_in).mul_(0.05).to(dtype))
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, fan_in).to(dtype)
                # name -> (strategy, call)
                variants = {f"dense {type(dense).__name__}": ("int8", lambda: dense(x))}
                for strategy in args.strategies.split(","):
                    variants.update({f"{name}{'' if strategy == 'int8' else '/' + strategy}":
                                     (strategy, lambda lib=lib, b=b, t=t: lib.quant_linear(x, [b], [t]))
                                     for name, (lib, t, b) in blocks.items()
                                     if strategy == "int8" or ("_PANELS" in name) == (strategy == "vnni")})
                times = {name: [] for name in variants}
                for _ in range(args.rounds):
                    for name, (strategy, fn) in variants.items():
                        for lib in libraries.values():
                            lib.set_quant_int8(strategy != "fp32")
                            lib.set_quant_panel_rows(2 ** 62 if strategy == "columns" else panel_rows)
                            if hasattr(lib, "set_quant_amx_rows"):
                                lib.set_quant_amx_rows(2 ** 62 if strategy == "vnni" else amx_rows)
                        times[name].append(timed(fn, args.seconds))
                for lib in libraries.values():
                    lib.set_quant_int8(True)
                    lib.set_quant_panel_rows(panel_rows)
                    if hasattr(lib, "set_quant_amx_rows"):
                        lib.set_quant_amx_rows(amx_rows)
                base = statistics.median(times[next(iter(variants))])
                cells = []
                for name, ts in times.items():
                    t = statistics.median(ts)
                    cells.append(f"{name} {t * 1e3:.3f} ms {2 * rows * out * fan_in / t / 1e9:.1f} GFLOP/s ({base / t:.2f}x)")
                print(f"{out}x{fan_in} {str(dtype).split('.')[1]} rows {rows}: " + "; ".join(cells), flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
