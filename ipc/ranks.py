"""RankProcesses: rank 0's side of the tensor-parallel ranks 1..world-1 (one process each).

Each rank is ``python -m <module> <spec> <rank> <args...>`` in its own session (a Ctrl-C meant for the
server does not reach it; it notices the server's exit by itself, through the group's pid checks),
pinned to its CPUs with sched_setaffinity and told its thread count through OMP_NUM_THREADS /
MKL_NUM_THREADS. A watchdog thread polls the processes every WATCH_S: the first rank found dead is
reaped, the group is marked failed (every wait of every rank raises RankDied) and ``on_death(rank,
returncode)`` is called once, from the watchdog thread. A rank's exit is a death whatever its code:
ranks are stopped by ``close()``, not by a message of their own.

The group's names are rank 0's (ipc/names.py unlinks them at close, at exit, or as stale at the next
start). Names a rank creates itself (its CPU LoRA workers' pool) are its to unlink; whatever one left
(SIGKILLed, crashed) is unlinked here once it is reaped.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ipc import names
from ipc.collective import ShmGroup

log = logging.getLogger("asyncserve.ipc")

REPO_ROOT = Path(__file__).resolve().parent.parent
WATCH_S = 0.05            # how often the watchdog polls the ranks
STOP_WAIT_S = 2.0         # after SIGTERM, before SIGKILL


class RankProcesses:
    """Starts ranks 1..world-1 of ``group``, reaps and supervises them; ``close()`` stops them and
    closes the group."""

    def __init__(self, group: ShmGroup, module: str, args: list[str], env: dict | None = None,
                 cores: list[list[int]] | None = None, on_death: Callable[[int, int], None] | None = None):
        if group.rank != 0:
            raise ValueError("rank 0 starts the other ranks")
        if cores is not None and len(cores) != group.world:
            raise ValueError(f"cores has {len(cores)} CPU groups for {group.world} ranks")
        self.group, self.on_death = group, on_death
        self.procs: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._closing = False
        base = dict(os.environ, **(env or {}))
        base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), base.get("PYTHONPATH")]))
        try:
            for rank in range(1, group.world):
                self.procs[rank] = self._spawn(rank, module, args, base, cores[rank] if cores else None)
        except BaseException:
            self._stop_all()
            raise
        self.pids = {rank: proc.pid for rank, proc in self.procs.items()}
        group.watch(self.pids)
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="asyncserve-tp-watchdog", daemon=True)
        self._watchdog.start()
        # a script that ends without close() (an offline LLM) stops its ranks now, not at their next pid check
        atexit.register(self.close)

    def _spawn(self, rank: int, module: str, args: list[str], env: dict, cores: list[int] | None) -> subprocess.Popen:
        if cores is not None:
            threads = str(len(cores))
            env = dict(env, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        cmd = [sys.executable, "-m", module, self.group.spec, str(rank), *args]
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        if cores is not None:
            try:
                # the child has just exec'd: torch's threads, started later, inherit the mask
                os.sched_setaffinity(proc.pid, cores)
            except OSError:
                proc.kill()
                proc.wait()
                raise
        return proc

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_S):
            dead = {rank: proc.returncode for rank, proc in self.procs.items() if proc.poll() is not None}
            if not dead:
                continue
            with self._lock:
                if self._closing:
                    return
                # a rank that exits because another died (RankDied) is not the cause: the group knows which was
                culprit = self.group.failed_rank
                rank = culprit if culprit in dead else min(dead)
                self.group.fail(rank)
            log.error("tensor-parallel rank %d (pid %d) exited with %d", rank, self.pids[rank], dead[rank])
            if self.on_death is not None:
                try:
                    self.on_death(rank, dead[rank])
                except Exception:
                    log.exception("on_death of tensor-parallel rank %d", rank)
            return

    def wait_ready(self, timeout_s: float) -> None:
        """Until every rank has called ``group.barrier()`` once (loaded); RankDied if one dies first or
        ``timeout_s`` passes."""
        self.group.barrier(timeout_s=timeout_s)

    def close(self) -> None:
        """Stop the ranks (SIGTERM, then SIGKILL after STOP_WAIT_S), reap them, close the group."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        atexit.unregister(self.close)
        self._stop.set()
        if threading.current_thread() is not self._watchdog:     # on_death may close from the watchdog
            self._watchdog.join()
        self._stop_all()
        self.group.close()

    def _stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.send_signal(signal.SIGCONT)     # a stopped rank takes its SIGTERM now
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        names.cleanup_stale(pids={proc.pid for proc in self.procs.values()})

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
