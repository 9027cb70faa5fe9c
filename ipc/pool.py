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

The pool supervises itself: a watchdog thread looks at the workers outside the job in flight every
WATCH_S, reaps a dead one at once (no zombie), replaces it, and notices a new one ready, so ``live``
(the asyncserve_cpu_workers gauge) tells the truth whether jobs come or not. A worker that keeps
dying is restarted after an exponential delay (BACKOFF_S doubling up to BACKOFF_MAX_S, each death
logged); one that lived HEALTHY_S starts the count again. The job's own workers are the job's
business (``collect``), so the two never touch one worker at once.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import posix_ipc
import torch

from ipc import names
from ipc.arena import AdapterHandle, ArenaReader
from ipc.layout import (CTL_BYTES, DTYPE_CODE, KIND_COMPUTE, KIND_STOP, MAX_PROJ, MAX_TASKS, STATUS_ERROR,
                        ControlBlock, element_size)

log = logging.getLogger("asyncserve.ipc")

REPO_ROOT = Path(__file__).resolve().parent.parent
WAIT_SLICE_S = 0.02       # how often a waiting collect checks that its workers are alive
STOP_WAIT_S = 2.0
WATCH_S = 0.1             # how often the watchdog looks at the workers
BACKOFF_S = 1.0           # the second death in a row waits this long before the restart; each next, twice
BACKOFF_MAX_S = 60.0
HEALTHY_S = 60.0          # a worker that lived this long died "first" again: restarted at once


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
    """What one job computes: projections sharing an input, each writing its columns of the output.
    Under tensor parallelism, rank ``rank`` of ``world``'s shard of them (S-LoRA §6): in and out
    features are the shard's, and each projection's A (row_parallel: x is the rank's slice of the
    inputs) or B^T (column-parallel: the rank's slice of the outputs) is sliced to match."""
    in_features: int
    out_features: int                              # width of the group's fused output
    projections: tuple[tuple[int, int], ...]       # (projection index, first output column)
    rank: int = 0
    world: int = 1
    row_parallel: bool = False


@dataclass
class _Worker:
    index: int
    generation: int = 0
    proc: subprocess.Popen | None = None       # None: dead, its restart due at restart_at
    req: posix_ipc.Semaphore | None = None
    done: posix_ipc.Semaphore | None = None
    ready: bool = False
    started: float = 0.0                        # monotonic time of its spawn
    deaths: int = 0                             # in a row (reset by a life of HEALTHY_S)
    died: int = 0                               # in all
    restart_at: float = 0.0


class WorkerPool:
    def __init__(self, arena: ArenaReader, num_workers: int, *, max_tokens: int, max_in: int, max_out: int,
                 dtype: torch.dtype, cpus: list[int] | None = None):
        """cpus: pin the workers to these CPUs (a tensor-parallel rank's cores); None: this process's."""
        if num_workers < 1:
            raise ValueError("a WorkerPool needs at least one worker")
        self.arena, self.dtype, self.cpus = arena, dtype, cpus
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
        # held while workers change (spawn, death, ready) and while a job is handed out
        self._lock = threading.Lock()
        for w in self.workers:
            self._spawn(w)
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="asyncserve-cpu-watchdog", daemon=True)
        self._watchdog.start()

    # -- worker processes -------------------------------------------------------------------------

    def _sem_name(self, w: _Worker, what: str) -> str:
        return f"{self.prefix}-w{w.index}.{w.generation}-{what}"

    def _spawn(self, w: _Worker) -> None:
        """Start the worker's process with fresh semaphores; on OSError nothing is left behind."""
        sems = []
        try:
            for what in ("req", "done"):
                sems.append(names.create_sem(self._sem_name(w, what)))
            cmd = [sys.executable, "-m", "ipc.worker", "--index", str(w.index), "--server-pid", str(os.getpid()),
                   "--arena", self.arena.name, "--slots", str(len(self.arena.directory)),
                   "--ctl", self._segments[0], "--x", self._segments[1], "--delta", self._segments[2],
                   "--req", sems[0].name, "--done", sems[1].name]
            env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
            # its own session: a Ctrl-C meant for the server does not reach the workers; they notice the
            # server's exit by themselves
            w.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            _drop(sems)
            raise
        if self.cpus is not None:
            try:
                # the child has just exec'd: its threads, started later, inherit the mask
                os.sched_setaffinity(w.proc.pid, self.cpus)
            except OSError:
                w.proc.kill()
                w.proc.wait()
                _drop(sems)
                raise
        w.req, w.done = sems
        w.ready, w.started = False, time.monotonic()

    def _retire(self, w: _Worker) -> None:
        """Kill (if alive) and reap the process, drop its semaphores."""
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait()
        _drop([w.req, w.done])
        w.proc, w.req, w.done, w.ready = None, None, None, False

    def _replace(self, w: _Worker, why: str) -> None:
        """The worker died or was killed for lateness: reap it now, restart it now or after its backoff
        (self._lock held)."""
        pid, was_ready = w.proc.pid, w.ready
        self._retire(w)
        now = time.monotonic()
        w.died += 1
        w.deaths = 1 if now - w.started >= HEALTHY_S else w.deaths + 1
        delay = _backoff(w.deaths)
        w.restart_at = now + delay
        log.log(logging.WARNING if w.deaths == 1 else logging.ERROR,
                "CPU LoRA worker %d (pid %d) %s%s; %s", w.index, pid, why, "" if was_ready else " before it was ready",
                "restarting it" if not delay else f"{w.deaths} deaths in a row: restarting it in {delay:g} s")
        if not delay:
            self._restart(w)

    def _restart(self, w: _Worker) -> None:
        w.generation += 1
        try:
            self._spawn(w)
        except OSError as e:             # no process or semaphore to be had now: try again later
            w.deaths += 1
            w.restart_at = time.monotonic() + _backoff(w.deaths)
            log.error("cannot start CPU LoRA worker %d (%s); trying again in %g s", w.index, e, _backoff(w.deaths))
            return
        self.restarts += 1

    def _supervise(self) -> None:
        """Reap and replace dead workers, restart those whose backoff is over, notice new ones ready;
        the job in flight's workers are left to collect (self._lock held)."""
        busy = self._job[0] if self._job is not None else ()
        for w in self.workers:
            if w in busy:
                continue
            if w.proc is None:
                if time.monotonic() >= w.restart_at:
                    self._restart(w)
            elif w.proc.poll() is not None:
                self._replace(w, f"died (exit {w.proc.returncode})")
            elif not w.ready:
                try:
                    w.done.acquire(0)
                    w.ready = True
                except posix_ipc.BusyError:
                    pass

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_S):
            with self._lock:
                if self._closed:
                    return
                try:
                    self._supervise()
                except Exception:        # the watchdog must outlive whatever one look at the workers meets
                    log.exception("CPU LoRA worker watchdog")

    def wait_ready(self, timeout: float) -> int:
        """Block until every worker is ready (or has died meanwhile, or waits for its restart: the
        watchdog restarts it in its time) or timeout passes; returns the ready count."""
        deadline = time.monotonic() + timeout
        died = [w.died for w in self.workers]
        while True:
            with self._lock:
                self._supervise()
                settled = all(w.ready or w.proc is None or w.died > d for w, d in zip(self.workers, died))
            if settled or time.monotonic() >= deadline:
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
        # x: [tokens, in] into shared memory (a device-to-host copy on GPU)
        x_view = torch.frombuffer(self._x_buf, dtype=self.dtype, count=tokens * group.in_features)
        x_view.view(tokens, group.in_features).copy_(x)
        with self._lock:
            self._supervise()
            ready = [w for w in self.workers if w.ready]
            if not ready:
                raise NoWorkers("no CPU LoRA worker is ready")
            total = sum(r1 - r0 for _, r0, r1 in tasks)
            k = max(1, min(len(ready), workers or len(ready), total))
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
                ctl["shard_rank"], ctl["shard_world"] = group.rank, group.world
                ctl["row_parallel"] = group.row_parallel
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
        deadline = time.monotonic() + timeout
        failure = None
        try:
            for w in used:
                error = self._wait(w, deadline)
                failure = failure or error
        finally:
            with self._lock:
                self._job = None         # its workers are the watchdog's again
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
                    with self._lock:
                        self._replace(w, f"died (exit {code}) during a job")
                    return WorkerDied(f"CPU LoRA worker {w.index} died (exit {code}) during a job; replaced")
                if time.monotonic() >= deadline:
                    with self._lock:
                        self._replace(w, "missed a job's deadline: killed")
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
        self._stop.set()
        with self._lock:
            self._closed = True
        self._watchdog.join()
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                self._ctl[w.index]["kind"] = KIND_STOP
                w.req.release()
        deadline = time.monotonic() + STOP_WAIT_S
        for w in self.workers:
            if w.proc is None:
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


def _backoff(deaths: int) -> float:
    """Seconds before restarting a worker after its ``deaths``-th death in a row: none after the first."""
    return 0.0 if deaths <= 1 else min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (deaths - 2))


def _drop(sems) -> None:
    for sem in sems:
        sem.close()
        names.unlink(sem.name)


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
