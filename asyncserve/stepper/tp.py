"""Tensor parallelism's rank 0 side and its one message per step (docs/tensor-parallel.md).

The ranks talk over a ShmGroup (CPU ranks, POSIX shared memory) or a DistGroup (torch.distributed:
gloo on CPU, NCCL with a GPU per rank; ipc/dist.py); both have the same interface, so only their
construction differs.

Rank 0 is the engine's ModelRunner: it schedules, prepares the step's inputs once, broadcasts them to
ranks 1..N-1 (stepper/tp_rank.py) as one TpStep (a small msgspec header and the inputs' arrays as raw
bytes), runs its own shard, all-reduces the row-parallel outputs with the others, and alone computes
logits and samples: sampled tokens never leave it. Every rank's pool has the same pages and rank 0's
block manager and pager decide for all: a step names the pages (block tables, KV write rows) and the
adapters paged in since the last step (their pages and host-arena block, whose rows each rank
copies its shard of) and, with CPU assist, the cold rows and their adapters' host-arena blocks (each
rank's own workers compute its shard of their LoRA), so no rank keeps any accounting of its own.

A rank that dies takes the engine down: the watchdog calls ``on_death`` (the server stops, exit 1),
and a step that waits on it raises EngineFailed (its requests get 503). Ranks run until they are
stopped (RankProcesses.close), so any exit of theirs is a death.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable

import msgspec
import numpy as np
import torch

from asyncserve.lora.batch import LoraBatch
from asyncserve.model.llama import PrefillChunk, StepInputs, decode_masks
from asyncserve.step import EngineFailed
from ipc.collective import RankDied
from ipc.dist import create_group
from ipc.ranks import RankProcesses

log = logging.getLogger("asyncserve.tp")

# seconds rank 0 waits for the ranks to load their shards before it gives up
READY_TIMEOUT_S = 600.0
# StepInputs' tensors a step carries (int64), then each prefill chunk's block table; the decodes'
# masks are rebuilt from their context lengths
_ARRAYS = ("input_ids", "positions", "write_rows", "decode_pages", "decode_lens", "sample_index")


class TpPageIn(msgspec.Struct, array_like=True):
    """An adapter rank 0 copied into its pages before this step: each rank copies its shard of the
    same rows (ipc host-arena block ``slot``/``arena_generation``) into the same pages."""
    generation: int                      # DeviceAdapter.generation on rank 0: the step names it by this
    slot: int
    arena_generation: int
    ranks: list[int]
    pages: list[int]


class TpColdRun(msgspec.Struct, array_like=True):
    """CPU assist: a run of the step's cold rows (rows[row0:row1] of TpStep.cold_rows) whose adapter's LoRA
    each rank's workers compute, their shard of it, from host-arena block ``slot``/``arena_generation``."""
    slot: int
    arena_generation: int
    row0: int
    row1: int
    ranks: list[int]


class TpStep(msgspec.Struct, array_like=True):
    page_ins: list[TpPageIn] = []
    merged: int | None = None            # generation of the adapter merged into the base weights
    num_decode: int = 0
    decode_tables: bool = False          # the decodes' block tables for kernels.paged_attention (CUDA)
    chunks: list[tuple[int, int, int]] = []    # prefill chunks' (start, end, first_pos)
    adapters: list[int] = []             # generations of the step's LoRA adapters (LoraBatch.adapters)
    seg_starts: list[int] = []
    seg_adapter: list[int] = []
    arrays: list[bytes] = []             # _ARRAYS, then the chunks' block tables, int64 native order
    # CPU assist, rank 0's decisions: the cold runs, the step's cold rows, the workers a job takes
    cold: list[TpColdRun] = []
    cold_rows: list[int] = []
    cold_workers: int = 0


def step_bytes(max_tokens: int, max_running: int, max_pages_per_seq: int, num_pages: int) -> int:
    """A bound on an encoded TpStep: its arrays, a page-in list naming every page, and the header."""
    arrays = 8 * (5 * max_tokens + 2 * max_running * (max_pages_per_seq + 1))
    cold = 9 * max_tokens + 64 * max_running        # the cold rows (msgpack ints) and runs
    return arrays + cold + 16 * num_pages + 64 * 2**10


def encode_step(inputs: StepInputs, batch: LoraBatch | None, page_ins: list[TpPageIn], merged: int | None,
                cold: tuple[list, list[int], int]) -> bytes:
    """cold: CPU assist's (tasks [(host block, row0, row1, ranks)], cold rows, workers per job)."""
    tasks, cold_rows, workers = cold
    nd = inputs.num_decode
    ctx = inputs.positions[:nd] + 1
    arrays = [inputs.input_ids, inputs.positions, inputs.write_rows, inputs.decode_pages, ctx, inputs.sample_index]
    arrays += [c.block_table for c in inputs.prefills]
    return msgspec.msgpack.encode(TpStep(
        page_ins=page_ins, merged=merged, num_decode=nd, decode_tables=inputs.decode_tables is not None,
        chunks=[(c.start, c.end, c.first_pos) for c in inputs.prefills],
        adapters=[a.generation for a in batch.adapters] if batch is not None else [],
        seg_starts=batch.seg_starts if batch is not None else [],
        seg_adapter=batch.seg_adapter if batch is not None else [],
        arrays=[t.cpu().numpy().tobytes() for t in arrays],
        cold=[TpColdRun(h.slot, h.generation, r0, r1, list(ranks)) for h, r0, r1, ranks in tasks],
        cold_rows=list(cold_rows), cold_workers=workers))


def decode_step(payload: bytes) -> TpStep:
    return msgspec.msgpack.decode(payload, type=TpStep)


def step_inputs(step: TpStep, block: int, device: torch.device) -> StepInputs:
    """The StepInputs rank 0 prepared, rebuilt from its message on ``device``."""
    arrays = [torch.from_numpy(np.frombuffer(b, dtype=np.int64).copy()) for b in step.arrays]
    ids, positions, write_rows, decode_pages, ctx, sample_index = arrays[:len(_ARRAYS)]
    nd = step.num_decode
    mask, padding = decode_masks(ctx, len(decode_pages) // max(nd, 1), block)
    chunks = [PrefillChunk(start, end, first, table.to(device))
              for (start, end, first), table in zip(step.chunks, arrays[len(_ARRAYS):])]
    tables = decode_pages.view(nd, -1).to(device) if step.decode_tables and nd else None
    return StepInputs(ids.to(device), positions.to(device), write_rows.to(device), nd, decode_pages.to(device),
                      mask[:, None, None, :].to(device), padding.to(device), chunks, sample_index.to(device),
                      decode_tables=tables)


class TensorParallel:
    """Ranks 1..N-1 as processes, their group (``backend``: shm, gloo or nccl), and rank 0's half of each
    step. CPU ranks are pinned to ``cores`` (one CPU list per rank); with nccl rank r runs on
    cuda:<device's index + r>."""

    def __init__(self, world: int, backend: str, cores: list[list[int]] | None, device: torch.device,
                 settings: dict, max_bytes: int, on_death: Callable[[str], None] | None = None):
        self.cores, self.backend = cores, backend
        self.on_death = on_death            # the engine's: the server stops (set after start, too)
        self.dead: str | None = None
        self.group = create_group(backend, world, max_bytes, first_device=device.index or 0)
        # per step: seconds and bytes of the broadcast and the all-reduces (scripts' --tp reports them)
        self.steps = 0
        self.broadcast_s = self.reduce_s = 0.0
        self.broadcast_bytes = self.reduce_bytes = 0
        try:
            self.processes = RankProcesses(self.group, "asyncserve.stepper.tp_rank", [json.dumps(settings)],
                                           cores=self.cores, on_death=self._died)
        except BaseException:
            self.group.close()
            raise

    @property
    def world(self) -> int:
        return self.group.world

    def wait_ready(self) -> None:
        """Until every rank has loaded its shard (each calls group.barrier() once, as rank 0 does here)."""
        t0 = time.perf_counter()
        try:
            self.processes.wait_ready(READY_TIMEOUT_S)
        except RankDied as e:
            raise EngineFailed(f"a tensor-parallel rank failed while loading its shard: {e}") from None
        first = self.group.device.index or 0
        where = (f"cores {';'.join(','.join(map(str, c)) for c in self.cores)}" if self.cores is not None
                 else f"devices cuda:{first}..cuda:{first + self.world - 1}")
        log.info("tensor parallelism: %d ranks over %s ready in %.1f s, %s", self.world, self.backend,
                 time.perf_counter() - t0, where)

    def _died(self, rank: int, returncode: int) -> None:
        self.dead = f"tensor-parallel rank {rank} exited with status {returncode}"
        log.error("%s: the engine cannot step any more", self.dead)
        if self.on_death is not None:
            self.on_death(self.dead)

    def send_step(self, inputs: StepInputs, batch: LoraBatch | None, written: list, merged: int | None,
                  pager, cold: tuple[list, list[int], int]) -> None:
        """Broadcast the step (written: the pager's page-ins copied for it; cold: CPU assist's tasks, rows
        and workers per job, as LayerAssist.begin_step takes them)."""
        page_ins = []
        for page_in in written:
            handle = pager.host_block(page_in.load)
            if handle is None:          # the tiers are inclusive: a resident adapter keeps its host block
                raise RuntimeError(f"adapter {page_in.device.name!r} was paged in without a host block")
            page_ins.append(TpPageIn(page_in.device.generation, handle.slot, handle.generation,
                                     list(page_in.device.ranks), list(page_in.device.pages)))
        payload = encode_step(inputs, batch, page_ins, merged, cold)
        t0 = time.perf_counter()
        self._call(self.group.broadcast, payload)
        self.broadcast_s += time.perf_counter() - t0
        self.broadcast_bytes += len(payload)
        self.steps += 1

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' partial sums of a row-parallel output, summed in place (NCCL: queued on the device;
        the time counted is the host's)."""
        t0 = time.perf_counter()
        self._call(self.group.all_reduce_, t)
        self.reduce_s += time.perf_counter() - t0
        self.reduce_bytes += t.numel() * t.element_size()
        return t

    def check(self) -> None:
        """After a step: EngineFailed if a rank died during it. An NCCL communicator aborted because of
        the death lets the step finish without that rank's partial sums: its tokens must not count."""
        if self.dead is not None:
            raise EngineFailed(self.dead)

    def _call(self, fn, *args):
        self.check()
        try:
            return fn(*args)
        except RankDied as e:
            raise EngineFailed(self.dead or f"a tensor-parallel rank stopped answering: {e}") from None

    def stats(self) -> dict[str, float]:
        """Per step so far: the broadcast's and the all-reduces' seconds and bytes."""
        n = max(self.steps, 1)
        return {"steps": self.steps, "broadcast_s": self.broadcast_s / n, "broadcast_bytes": self.broadcast_bytes / n,
                "reduce_s": self.reduce_s / n, "reduce_bytes": self.reduce_bytes / n}

    def close(self) -> None:
        """Stop the ranks (RankProcesses: SIGTERM, then SIGKILL) and remove the group's shared memory."""
        self.processes.close()

