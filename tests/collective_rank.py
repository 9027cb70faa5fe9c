"""A tensor-parallel rank for tests/test_collective.py:
``python -m collective_rank <spec> <rank> <scenario> <out> [<sleeper rank>]`` (tests/ on PYTHONPATH).
Attaches (a ShmGroup or a DistGroup, by the spec), says ready (group.barrier()), runs the scenario and writes its outcome to <out>/rank<r>.pt
(tensors of ``script``) or <out>/rank<r>.json (how a ``wait_<op>`` ended). The sleeper rank, if
given, only sleeps (the test kills or stops it).

``python -m collective_rank host <world> <out>`` is a rank 0 of its own: it creates a group, starts
ranks 1.. in scenario ``wait_broadcast`` and writes its names and pids to <out>/host.json, then sleeps
(the test SIGKILLs it).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from ipc.collective import RankDied, ShmGroup
from ipc.dist import DistGroup, attach_group
from ipc.ranks import RankProcesses

MAX_BYTES = 96 << 10
SPLIT_BYTES = 32 << 10     # the scripted sizes take both all-reduce paths
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PLAN_SIZES = (0, 1, 13, 4096, MAX_BYTES)


def sizes(dtype: torch.dtype) -> list[int]:
    """Odd element counts on both sides of the split, up to the largest that fits."""
    esize = torch.empty(0, dtype=dtype).element_size()
    return [1, 7, 1023, 4097, SPLIT_BYTES // esize + 3, MAX_BYTES // esize]


def data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return (torch.randn(n, generator=g) * (rank + 1)).to(dtype)


def plan(size: int) -> bytes:
    return bytes((i * 7 + size) % 256 for i in range(size))


def gather_part(rank: int) -> torch.Tensor:
    return data(rank, 3 * 37, torch.float32).view(3, 37)


def script(group: ShmGroup | DistGroup) -> dict:
    """The collectives every rank runs in this order; what each returned, by name."""
    if isinstance(group, ShmGroup):
        group.split_bytes = SPLIT_BYTES
    out = {}
    for dtype in DTYPES:
        for n in sizes(dtype):
            out[f"reduce {dtype} {n}"] = group.all_reduce_(data(group.rank, n, dtype))
    too_big = [torch.zeros(MAX_BYTES // 4 + 1), torch.zeros(MAX_BYTES // 2 + 1, dtype=torch.bfloat16),
               torch.zeros(2, MAX_BYTES // 4)]
    out["too big"] = 0
    for t in too_big:
        try:
            group.all_reduce_(t)
        except ValueError:
            out["too big"] += 1
    out["after too big"] = group.all_reduce_(data(group.rank, 5, torch.float32))
    for size in PLAN_SIZES:
        out[f"plan {size}"] = group.broadcast(plan(size) if group.rank == 0 else None)
    if group.rank == 0:
        for size in (MAX_BYTES + 1, 2 * MAX_BYTES):
            try:
                group.broadcast(bytes(size))
            except ValueError:
                out["too big"] += 1
    out["plan after too big"] = group.broadcast(b"go" if group.rank == 0 else None)
    out["gather"] = group.gather(gather_part(group.rank))
    return out


def wait_in(group: ShmGroup | DistGroup, op: str) -> None:
    if op == "all_reduce":
        group.all_reduce_(torch.ones(1000))
    elif op == "barrier":
        group.barrier()
    elif op == "broadcast":
        group.broadcast(None if group.rank else b"plan")
    else:
        raise ValueError(op)


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.rename(path)


def rank_main(spec: str, rank: int, scenario: str, out: Path, sleeper: int | None) -> int:
    torch.set_num_threads(1)
    group = attach_group(spec, rank)
    group.barrier()
    if rank == sleeper:
        time.sleep(120)           # the test kills or stops this rank
        return 0
    if scenario == "script":
        torch.save(script(group), out / f"rank{rank}.pt")
        group.barrier()           # saved
        return 0
    op = scenario.removeprefix("wait_")
    start = time.monotonic()
    try:
        wait_in(group, op)
        outcome = {"error": None}
    except RankDied as e:
        outcome = {"error": type(e).__name__, "message": str(e)}
    outcome["seconds"] = time.monotonic() - start
    write_json(out / f"rank{rank}.json", outcome)
    return 3


def host_main(world: int, out: Path) -> int:
    torch.set_num_threads(1)
    group = ShmGroup.create(world, 4096)
    ranks = RankProcesses(group, "collective_rank", ["wait_broadcast", str(out)])
    ranks.wait_ready(120)
    write_json(out / "host.json", {"prefix": group.prefix, "pid": os.getpid(), "ranks": ranks.pids})
    time.sleep(120)               # the test SIGKILLs this process
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "host":
        sys.exit(host_main(int(sys.argv[2]), Path(sys.argv[3])))
    sys.exit(rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]),
                       int(sys.argv[5]) if len(sys.argv) > 5 else None))
