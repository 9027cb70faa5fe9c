"""WorkerPool: the server's side of the CPU LoRA workers (CaraServe §4.2).

Per worker: a control block in the pool's ``ctl`` segment and two semaphores, ``req`` (server ->
worker: a job is in the block) and ``done`` (worker -> server: the job's deltas are written, or it
failed; also posted once when the worker is ready). Inputs and outputs are two shared segments
sized for the largest step: ``x`` [max_tokens, max_in] and ``delta`` [max_tokens, max_out], in the
model's activation dtype. A job is one (layer, projection group) of one step; its rows are split
into contiguous ranges, one per worker, each worker writing its own rows of ``delta``.

One job is in flight at a time: ``submit`` writes x and posts, the caller computes the base model's
projection meanwhile, then ``collect`` waits for every worker of the job. A worker that dies
(SIGKILL) or misses the deadline fails the job with WorkerDied / WorkerTimeout (both
CpuAssistError; the caller recomputes those deltas on its own path) and is replaced by a new process
with fresh semaphores, counted in ``restarts``. A new worker takes jobs once it reports ready.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import posix_ipc
import torch

from ipc import names
from ipc.arena import AdapterHandle, HostArena
from ipc.layout import (CTL_BYTES, DTYPE_CODE, KIND_COMPUTE, KIND_STOP, MAX_PROJ, MAX_TASKS, STATUS_ERROR,
                        ControlBlock, element_size)

log = logging.getLogger("asyncserve.ipc")

REPO_ROOT = Path(__file__).resolve().parent.parent
WAIT_SLICE_S = 0.02       # how often a waiting collect checks that its workers are alive
STOP_WAIT_S = 2.0


class CpuAssistError(RuntimeError):
    """The workers did not deliver this job's deltas; compute them on the device path instead."""


class WorkerDied(CpuAssistError):
    pass


class WorkerTimeout(CpuAssistError):
    pass


class JobFailed(CpuAssistError):
    """A worker reported an error (its message is in the exception); the worker lives on."""


class NoWorkers(CpuAssistError):
    pass


@dataclass(frozen=True)
class ProjectionGroup:
    """What one job computes: projections sharing an input, each writing its columns of the output."""
    in_features: int
    out_features: int                              # width of the group's fused output
    projections: tuple[tuple[int, int], ...]       # (projection index, first output column)


@dataclass
class _Worker:
    index: int
    generation: int = 0
    proc: subprocess.Popen | None = None
    req: posix_ipc.Semaphore | None = None
    done: posix_ipc.Semaphore | None = None
    ready: bool = False
    broken: bool = False          # died before it was ever ready: not restarted


class WorkerPool:
    def __init__(self, arena: HostArena, num_workers: int, *, max_tokens: int, max_in: int, max_out: int,
                 dtype: torch.dtype):
        if num_workers < 1:
            raise ValueError("a WorkerPool needs at least one worker")
        self.arena, self.dtype = arena, dtype
        self.max_tokens, self.max_in, self.max_out = max_tokens, max_in, max_out
        self.prefix = names.new_prefix()
        self._segments = [self.prefix + "-ctl", self.prefix + "-x", self.prefix + "-delta"]
        esize = element_size(dtype)
        self._ctl_buf = names.create_shm(self._segments[0], num_workers * CTL_BYTES)
        self._x_buf = names.create_shm(self._segments[1], max_tokens * max_in * esize)
        self._delta_buf = names.create_shm(self._segments[2], max_tokens * max_out * esize)
        self._ctl = [ControlBlock(self._ctl_buf, i) for i in range(num_workers)]
        self.workers = [_Worker(i) for i in range(num_workers)]
        self.restarts = 0
        self._seq = 0
        self._job: tuple[list[_Worker], int, int] | None = None      # (workers, tokens, out_features)
        self._closed = False
        for w in self.workers:
            self._spawn(w)

    # -- worker processes -------------------------------------------------------------------------

    def _sem_name(self, w: _Worker, what: str) -> str:
        return f"{self.prefix}-w{w.index}.{w.generation}-{what}"

    def _spawn(self, w: _Worker) -> None:
        w.req = names.create_sem(self._sem_name(w, "req"))
        w.done = names.create_sem(self._sem_name(w, "done"))
        w.ready = False
        cmd = [sys.executable, "-m", "ipc.worker", "--index", str(w.index), "--server-pid", str(os.getpid()),
               "--arena", self.arena.name, "--slots", str(len(self.arena.directory)),
               "--ctl", self._segments[0], "--x", self._segments[1], "--delta", self._segments[2],
               "--req", w.req.name, "--done", w.done.name]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        # its own session: a Ctrl-C meant for the server does not reach the workers; they notice the
        # server's exit by themselves
        w.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)

    def _retire(self, w: _Worker) -> None:
        """Kill (if alive) and reap the process, drop its semaphores."""
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait()
        for sem in (w.req, w.done):
            sem.close()
            names.unlink(sem.name)

    def _restart(self, w: _Worker) -> None:
        self._retire(w)
        w.generation += 1
        self.restarts += 1
        self._spawn(w)

    def _refresh(self) -> None:
        """Notice workers that became ready, and replace ready ones that died since."""
        for w in self.workers:
            if w.broken:
                continue
            if w.proc.poll() is not None:
                if w.ready:
                    log.warning("CPU LoRA worker %d (pid %d) died (exit %s); restarting it",
                                w.index, w.proc.pid, w.proc.returncode)
                    self._restart(w)
                else:
                    log.error("CPU LoRA worker %d exited with %s before it was ready; not restarted",
                              w.index, w.proc.returncode)
                    self._retire(w)
                    w.broken = True
            elif not w.ready:
                try:
                    w.done.acquire(0)
                    w.ready = True
                except posix_ipc.BusyError:
                    pass

    def wait_ready(self, timeout: float) -> int:
        """Block until every worker is ready (or broken) or timeout passes; returns the ready count."""
        deadline = time.monotonic() + timeout
        while True:
            self._refresh()
            if all(w.ready or w.broken for w in self.workers) or time.monotonic() >= deadline:
                return self.live
            time.sleep(0.01)

    @property
    def live(self) -> int:
        """Workers ready to take jobs (the asyncserve_cpu_workers gauge)."""
        return sum(w.ready for w in self.workers)

    # -- jobs -------------------------------------------------------------------------------------

    def submit(self, layer: int, group: ProjectionGroup, x: torch.Tensor,
               tasks: list[tuple[AdapterHandle, int, int]], workers: int | None = None) -> int:
        """Start computing delta[row0:row1] = x[row0:row1] · A · B · scaling of each task's adapter
        for the group's projections of ``layer``. x: [tokens, group.in_features] (any device).
        Rows outside every task are left unspecified. Splits the tasks' rows across ``workers``
        ready workers (default: all); returns how many took part."""
        if self._job is not None:
            raise RuntimeError("collect() the job in flight before submitting another")
        tokens = x.shape[0]
        if tokens > self.max_tokens or group.in_features > self.max_in or group.out_features > self.max_out:
            raise ValueError(f"job of {tokens} x {group.in_features} -> {group.out_features} exceeds the pool's "
                             f"{self.max_tokens} x {self.max_in} -> {self.max_out}")
        if x.shape[1] != group.in_features:
            raise ValueError(f"x has {x.shape[1]} features, the group takes {group.in_features}")
        if len(group.projections) > MAX_PROJ or len(tasks) > MAX_TASKS:
            raise ValueError(f"at most {MAX_PROJ} projections and {MAX_TASKS} tasks per job "
                             "(merge neighbouring rows of one adapter into one task)")
        self._refresh()
        ready = [w for w in self.workers if w.ready]
        if not ready:
            raise NoWorkers("no CPU LoRA worker is ready")
        total = sum(r1 - r0 for _, r0, r1 in tasks)
        k = max(1, min(len(ready), workers or len(ready), total))

        # x: [tokens, in] into shared memory (a device-to-host copy on GPU)
        x_view = torch.frombuffer(self._x_buf, dtype=self.dtype, count=tokens * group.in_features)
        x_view.view(tokens, group.in_features).copy_(x)
        self._seq += 1
        chunk = -(-total // k)
        parts = _split_rows(tasks, chunk)
        used = ready[:len(parts)]
        for w, part in zip(used, parts):
            ctl = self._ctl[w.index]
            ctl["seq"], ctl["kind"], ctl["layer"] = self._seq, KIND_COMPUTE, layer
            ctl["in_features"], ctl["out_features"] = group.in_features, group.out_features
            ctl["dtype"] = DTYPE_CODE[self.dtype]
            ctl["num_projections"], ctl["num_tasks"] = len(group.projections), len(part)
            ctl.projections[:len(group.projections)] = group.projections
            ctl.tasks[:len(part)] = [(h.slot, h.generation, r0, r1) for h, r0, r1 in part]
            w.req.release()
        self._job = (used, tokens, group.out_features)
        return len(used)

    def collect(self, timeout: float) -> torch.Tensor:
        """Wait for the job's deltas: [tokens, group.out_features], a view of shared memory valid until
        the next submit. Raises a CpuAssistError subclass if any worker fails; the other workers of
        the job are still waited for, so the next job starts clean."""
        if self._job is None:
            raise RuntimeError("no job in flight: submit() first")
        used, tokens, out_features = self._job
        self._job = None
        deadline = time.monotonic() + timeout
        failure = None
        for w in used:
            error = self._wait(w, deadline)
            failure = failure or error
        if failure is not None:
            raise failure
        delta = torch.frombuffer(self._delta_buf, dtype=self.dtype, count=tokens * out_features)
        return delta.view(tokens, out_features)

    def _wait(self, w: _Worker, deadline: float) -> CpuAssistError | None:
        ctl = self._ctl[w.index]
        while True:
            try:
                w.done.acquire(max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
            except posix_ipc.BusyError:
                if w.proc.poll() is not None:
                    code = w.proc.returncode
                    self._restart(w)
                    return WorkerDied(f"CPU LoRA worker {w.index} died (exit {code}) during a job; restarted")
                if time.monotonic() >= deadline:
                    self._restart(w)
                    return WorkerTimeout(f"CPU LoRA worker {w.index} missed the job's deadline; replaced")
                continue
            if ctl["done_seq"] != self._seq:
                continue         # not this job's post
            if ctl["status"] == STATUS_ERROR:
                return JobFailed(f"CPU LoRA worker {w.index}: {ctl.error_message()}")
            return None

    # -- shutdown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (a stop job, then SIGKILL after STOP_WAIT_S), unlink every name."""
        if self._closed:
            return
        self._closed = True
        for w in self.workers:
            if not w.broken and w.proc.poll() is None:
                self._ctl[w.index]["kind"] = KIND_STOP
                w.req.release()
        deadline = time.monotonic() + STOP_WAIT_S
        for w in self.workers:
            if w.broken:
                continue
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self._retire(w)
        for name in self._segments:
            names.unlink(name)
        self._ctl = []
        for buf in (self._ctl_buf, self._x_buf, self._delta_buf):
            names.close_map(buf)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _split_rows(tasks: list[tuple[AdapterHandle, int, int]], chunk: int) -> list[list[tuple[AdapterHandle, int, int]]]:
    """Cut the tasks' rows, in order, into parts of ``chunk`` rows (the last may be shorter)."""
    parts, part, room = [], [], chunk
    for handle, r0, r1 in tasks:
        while r0 < r1:
            take = min(room, r1 - r0)
            part.append((handle, r0, r0 + take))
            r0, room = r0 + take, room - take
            if room == 0:
                parts.append(part)
                part, room = [], chunk
    if part:
        parts.append(part)
    return parts
