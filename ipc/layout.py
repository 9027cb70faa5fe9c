"""Byte layouts shared by the server and the workers: the arena's directory, an adapter's index
table, and a worker's control block. numpy structured dtypes, read in place on the mappings.

Arena (one segment, written by the server only):

    [directory: SLOTS x DIR_ENTRY][blocks ...]
    block of an adapter: [index: L*P x INDEX_ENTRY][A and B^T tensors, 64-byte aligned]

``index[layer * P + p]`` describes projection p of a layer: rank (0: not targeted), fan_in,
fan_out, scaling, and the arena byte offsets of A [rank, fan_in] and B^T [rank, fan_out], both in
the block's dtype. A directory slot's generation bumps whenever the slot is released, so a job
naming a released adapter fails instead of reading reused memory.

Control block (one per worker, in the pool's ``ctl`` segment): a CTL header, then the job's
projections (MAX_PROJ x (p, column offset)) and tasks (MAX_TASKS x (slot, generation, row0, row1)),
then an error message the worker writes when a job fails. Under tensor parallelism the header's
shard (rank of world) and row_parallel say which slice of each projection the job computes: a
row-parallel one's A columns of the rank's inputs, a column-parallel one's B^T columns of its outputs.
"""
from __future__ import annotations

import numpy as np
import torch

ALIGN = 64

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES)}

DIR_ENTRY = np.dtype([("live", "<i8"), ("generation", "<i8"), ("offset", "<i8"), ("nbytes", "<i8"),
                      ("num_layers", "<i8"), ("num_projections", "<i8"), ("dtype", "<i8")])

INDEX_ENTRY = np.dtype([("rank", "<i4"), ("fan_in", "<i4"), ("fan_out", "<i4"), ("scaling", "<f4"),
                        ("a_offset", "<i8"), ("b_offset", "<i8")])

# control block header fields (int64 each)
CTL = np.dtype([("seq", "<i8"), ("kind", "<i8"), ("layer", "<i8"), ("in_features", "<i8"),
                ("out_features", "<i8"), ("dtype", "<i8"), ("num_projections", "<i8"), ("num_tasks", "<i8"),
                ("done_seq", "<i8"), ("status", "<i8"), ("worker_pid", "<i8"),
                ("shard_rank", "<i8"), ("shard_world", "<i8"), ("row_parallel", "<i8")])
KIND_COMPUTE, KIND_STOP = 0, 1
STATUS_OK, STATUS_ERROR = 0, 1
MAX_PROJ = 8
MAX_TASKS = 256
ERROR_BYTES = 512
PROJ_OFFSET = CTL.itemsize
TASK_OFFSET = PROJ_OFFSET + MAX_PROJ * 2 * 8
ERROR_OFFSET = TASK_OFFSET + MAX_TASKS * 4 * 8
CTL_BYTES = -(-(ERROR_OFFSET + ERROR_BYTES) // ALIGN) * ALIGN


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


class ControlBlock:
    """numpy views of one worker's control block inside the ``ctl`` mapping."""

    def __init__(self, buffer, index: int):
        base = index * CTL_BYTES
        self.header = np.frombuffer(buffer, dtype=CTL, count=1, offset=base)[0:1]
        self.projections = np.frombuffer(buffer, dtype="<i8", count=MAX_PROJ * 2,
                                         offset=base + PROJ_OFFSET).reshape(MAX_PROJ, 2)
        self.tasks = np.frombuffer(buffer, dtype="<i8", count=MAX_TASKS * 4,
                                   offset=base + TASK_OFFSET).reshape(MAX_TASKS, 4)
        self.error = np.frombuffer(buffer, dtype=np.uint8, count=ERROR_BYTES, offset=base + ERROR_OFFSET)

    def __getitem__(self, field: str) -> int:
        return int(self.header[field][0])

    def __setitem__(self, field: str, value: int) -> None:
        self.header[field] = value

    def set_error(self, message: str) -> None:
        data = message.encode("utf-8", "replace")[:ERROR_BYTES - 1]
        self.error[:] = 0
        self.error[:len(data)] = np.frombuffer(data, dtype=np.uint8)

    def error_message(self) -> str:
        return bytes(self.error).split(b"\0", 1)[0].decode("utf-8", "replace")
