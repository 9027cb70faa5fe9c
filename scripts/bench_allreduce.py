"""All-reduce latency and bandwidth between tensor-parallel ranks on this host: the ShmGroup
(ipc/collective.py) or, with --backend gloo, the DistGroup over gloo (ipc/dist.py).

    .venv/bin/python scripts/bench_allreduce.py [--world 2] [--cores "0;1"] [--backend shm|gloo] [--out results.json]

Rank 0 is this process, ranks 1.. are copies of this script started by ipc.RankProcesses; each rank is
pinned to its CPUs (--cores, as --tp-cores; default one core per rank from cores_for_ranks) with that
many torch threads. Every rank runs the same cases in the same order:

- sync: a barrier (one arrival and one wait per rank) with each spin budget before the semaphore sleep:
  what one phase of a collective costs, spinning against sleeping on the semaphore;
- all_reduce: the activations a CPU decode step all-reduces twice per layer ([tokens, hidden]), float32
  and bfloat16, each with the one-phase sum (every rank sums the whole tensor) and the split one
  (reduce-scatter then all-gather), at the default spin; with --backend gloo, gloo's all-reduce;
- plan: a step plan's bytes from rank 0 to every rank, then a barrier (so that rank 0's time covers the
  delivery), over the group's broadcast (shared memory) and, with --backend gloo, over gloo itself
  (an int64 size, then the bytes as uint8: what broadcasting the plan over the process group costs;
  ipc/dist.py keeps it on shared memory). The plan cases' difference is the broadcasts'.

(sync runs for the ShmGroup only: a DistGroup's barrier is its control ShmGroup's.)

Prints the median and 90th percentile over many iterations in microseconds, and GB/s of the tensor's
bytes over the median (algorithm bandwidth).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))

import torch.distributed as dist  # noqa: E402

from ipc.collective import SPIN_US, ShmGroup, cores_for_ranks  # noqa: E402
from ipc.dist import SPEC_PREFIX, DistGroup, attach_group, create_group  # noqa: E402
from ipc.ranks import RankProcesses  # noqa: E402

SHAPES = [(16, 576), (64, 896), (16, 2048), (256, 2048), (256, 4096)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SPINS_US = [0.0, 5.0, 20.0, 50.0, 200.0]
PLAN_BYTES = [1 << 10, 2 << 10, 16 << 10]      # W1's decode steps' plans are ~1-2 KB


def cases(iterations: int, backend: str) -> list[dict]:
    out = []
    if backend == "shm":
        out += [{"kind": "sync", "spin_us": spin, "iterations": iterations} for spin in SPINS_US]
    for nbytes in PLAN_BYTES:
        for via in ("shm", "gloo") if backend == "gloo" else ("shm",):
            out.append({"kind": "plan", "via": via, "nbytes": nbytes, "iterations": iterations})
    for tokens, hidden in SHAPES:
        for dtype in DTYPES:
            nbytes = tokens * hidden * DTYPES[dtype].itemsize
            # fewer iterations of the big ones: about the same time per case
            n = max(50, min(iterations, int(iterations * 64e3 / nbytes)))
            for path in ("one-phase", "split") if backend == "shm" else (backend,):
                out.append({"kind": "all_reduce", "shape": [tokens, hidden], "dtype": dtype, "path": path,
                            "iterations": n, "nbytes": nbytes})
    return out


def gloo_broadcast(group: DistGroup, payload: bytes | None) -> bytes:
    """The plan over the process group: its size, then its bytes."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    size = torch.tensor([len(payload) if group.rank == 0 else 0], dtype=torch.int64)
    group.process_group.broadcast([size], options).wait()
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if group.rank == 0
            else torch.empty(int(size), dtype=torch.uint8))
    group.process_group.broadcast([data], options).wait()
    return data.numpy().tobytes()


def run(group: ShmGroup | DistGroup, case: dict) -> list[float]:
    """Runs a case on this rank; the time of each iteration in seconds (after a tenth as warm-up)."""
    warmup = max(5, case["iterations"] // 10)
    times = []
    if case["kind"] == "sync":
        group.spin_s = case["spin_us"] * 1e-6
        for i in range(warmup + case["iterations"]):
            start = time.perf_counter()
            group.barrier()
            times.append(time.perf_counter() - start)
        group.spin_s = SPIN_US * 1e-6
    elif case["kind"] == "plan":
        payload = bytes(range(256)) * (case["nbytes"] // 256) if group.rank == 0 else None
        send = group.broadcast if case["via"] == "shm" else lambda p: gloo_broadcast(group, p)
        for i in range(warmup + case["iterations"]):
            start = time.perf_counter()
            got = send(payload)
            group.barrier()
            times.append(time.perf_counter() - start)
        assert len(got) == case["nbytes"]
    else:
        if case["path"] in ("one-phase", "split"):
            group.split_bytes = 0 if case["path"] == "split" else 1 << 62
        t = torch.randn(*case["shape"]).to(DTYPES[case["dtype"]])
        source = t.clone()
        for i in range(warmup + case["iterations"]):
            t.copy_(source)
            start = time.perf_counter()
            group.all_reduce_(t)
            times.append(time.perf_counter() - start)
    group.barrier()          # the next case starts together
    return times[warmup:]


def rank_main(spec: str, rank: int, case_list: str) -> None:
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    group = attach_group(spec, rank)
    group.barrier()
    for case in json.loads(case_list):
        run(group, case)
    group.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--cores", default=None, help='CPUs per rank, "0;1" (default: one core per rank)')
    ap.add_argument("--iterations", type=int, default=3000, help="of the smallest cases (default 3000)")
    ap.add_argument("--backend", default="shm", choices=["shm", "gloo"], help="the group (default: shm)")
    ap.add_argument("--out", type=Path, help="write the results as JSON")
    args = ap.parse_args()
    cores = cores_for_ranks(args.world, args.cores)
    if args.cores is None:
        cores = [c[:1] for c in cores]            # one core per rank
    os.sched_setaffinity(0, cores[0])
    torch.set_num_threads(len(cores[0]))
    case_list = cases(args.iterations, args.backend)
    max_bytes = max(c.get("nbytes", 0) for c in case_list)
    group = create_group(args.backend, args.world, max_bytes)
    ranks = RankProcesses(group, "bench_allreduce", [json.dumps(case_list)], env={"PYTHONPATH": str(SCRIPTS)},
                          cores=cores)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"{cpu}; world {args.world}; {args.backend}; cores per rank {cores}; torch {torch.__version__}")
    results = []
    try:
        ranks.wait_ready(120)
        for case in case_list:
            times = run(group, case)
            median, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
            row = dict(case, median_us=median * 1e6, p90_us=p90 * 1e6)
            if case["kind"] == "sync":
                print(f"sync   spin {case['spin_us']:6.1f} us          median {row['median_us']:8.1f} us  "
                      f"p90 {row['p90_us']:8.1f} us")
            elif case["kind"] == "plan":
                print(f"plan   {case['nbytes']:6d} B over {case['via']:4} + barrier  median {row['median_us']:8.1f} us  "
                      f"p90 {row['p90_us']:8.1f} us")
            else:
                row["gb_s"] = case["nbytes"] / median / 1e9
                shape = "x".join(map(str, case["shape"]))
                print(f"reduce {shape:>9} {case['dtype']:8} {case['path']:9} {case['nbytes'] / 1024:7.0f} KiB  "
                      f"median {row['median_us']:8.1f} us  p90 {row['p90_us']:8.1f} us  {row['gb_s']:6.2f} GB/s")
            results.append(row)
    finally:
        ranks.close()
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu, "world": args.world, "backend": args.backend, "cores": cores,
                                        "results": results}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1].startswith(("/", SPEC_PREFIX)):        # a rank started by RankProcesses
        rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    else:
        main()
