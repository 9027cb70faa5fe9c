"""A CPU LoRA worker: ``python -m ipc.worker ...`` (started by WorkerPool, one torch thread).

Attaches to the arena and the pool's segments, posts ``done`` once to say it is ready, then loops:
wait for ``req``, compute the job described in its control block, write its rows of ``delta``,
post ``done``. Exits on a stop job, or when its server is gone (checked while idle every POLL_S).
Computes in float32 whatever the storage dtype (bf16 weights and activations are widened per job)
and rounds the delta once into the activation dtype. A tensor-parallel rank's job names its shard
(ipc/layout.py): the worker reads only that slice of A or B^T from the arena.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import posix_ipc
import torch

from ipc import names
from ipc.arena import shard_tensors, tensors
from ipc.layout import (DIR_ENTRY, DTYPES, INDEX_ENTRY, KIND_STOP, STATUS_ERROR, STATUS_OK, ControlBlock,
                        element_size)

POLL_S = 0.5


def run_job(ctl: ControlBlock, arena, directory: np.ndarray, x_buf, delta_buf) -> None:
    layer, fan_in, out_features = ctl["layer"], ctl["in_features"], ctl["out_features"]
    dtype = DTYPES[ctl["dtype"]]
    esize = element_size(dtype)
    projections = ctl.projections[:ctl["num_projections"]].tolist()
    shard = ctl["shard_rank"], ctl["shard_world"], bool(ctl["row_parallel"])
    for slot, generation, row0, row1 in ctl.tasks[:ctl["num_tasks"]].tolist():
        entry = directory[slot]
        if not entry["live"] or int(entry["generation"]) != generation:
            raise LookupError(f"adapter slot {slot} generation {generation} was released")
        rows = row1 - row0
        # x: [rows, in] -> float32; out: [rows, out_features] of the group's fused output
        x = torch.frombuffer(x_buf, dtype=dtype, count=rows * fan_in, offset=row0 * fan_in * esize)
        x = x.view(rows, fan_in).float()
        out = torch.frombuffer(delta_buf, dtype=dtype, count=rows * out_features,
                               offset=row0 * out_features * esize).view(rows, out_features)
        out.zero_()
        num_projections = int(entry["num_projections"])
        index = np.frombuffer(arena, dtype=INDEX_ENTRY, count=int(entry["num_layers"]) * num_projections,
                              offset=int(entry["offset"]))
        weight_dtype = DTYPES[int(entry["dtype"])]
        for p, column in projections:
            e = index[layer * num_projections + p]
            if not e["rank"]:
                continue          # the adapter does not target p: its columns stay zero
            # the job's shard of A [r, in] and B^T [r, out]: strided views of the arena, no copy
            a, bt = shard_tensors(*tensors(arena, e, weight_dtype), *shard)
            if a.shape[1] != fan_in or column + bt.shape[1] > out_features:
                raise ValueError(f"projection {p} is {a.shape[1]} -> {bt.shape[1]} in shard {shard[0]} of "
                                 f"{shard[1]}, the job has {fan_in} -> columns {column}.. of {out_features}")
            delta = (x @ a.float().t()) @ bt.float()       # [rows, r] @ [r, out]
            delta.mul_(float(e["scaling"]))
            out[:, column:column + bt.shape[1]] = delta


def serve(args: argparse.Namespace) -> None:
    arena = names.attach_shm(args.arena)
    directory = np.frombuffer(arena, dtype=DIR_ENTRY, count=args.slots)
    ctl_buf, x_buf, delta_buf = (names.attach_shm(n) for n in (args.ctl, args.x, args.delta))
    ctl = ControlBlock(ctl_buf, args.index)
    req, done = posix_ipc.Semaphore(args.req), posix_ipc.Semaphore(args.done)
    ctl["worker_pid"] = os.getpid()
    done.release()                     # ready
    while True:
        try:
            req.acquire(POLL_S)
        except posix_ipc.BusyError:
            if os.getppid() != args.server_pid:
                return                 # the server is gone (we were reparented)
            continue
        if ctl["kind"] == KIND_STOP:
            return
        try:
            run_job(ctl, arena, directory, x_buf, delta_buf)
            ctl["status"] = STATUS_OK
        except Exception as e:         # reported to the server, which recomputes; the worker lives on
            ctl.set_error(f"{type(e).__name__}: {e}")
            ctl["status"] = STATUS_ERROR
        ctl["done_seq"] = ctl["seq"]
        done.release()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="asyncserve CPU LoRA worker (started by ipc.WorkerPool)")
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--server-pid", type=int, required=True)
    ap.add_argument("--arena", required=True)
    ap.add_argument("--slots", type=int, required=True)
    for name in ("ctl", "x", "delta", "req", "done"):
        ap.add_argument(f"--{name}", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    try:
        serve(args)
    except KeyboardInterrupt:
        pass
    # nothing of a worker's needs tearing down (the server owns every shared name): skip the interpreter's
    # teardown of torch (~2 s on a loaded 2-core machine), so a pool's close, and a tensor-parallel rank's
    # stop that closes its pool, take a moment, not seconds
    os._exit(0)


if __name__ == "__main__":
    main()
