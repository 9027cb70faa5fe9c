"""DistGroup: the tensor-parallel ranks' collectives over torch.distributed (NCCL between GPUs, gloo
between CPU processes), with ShmGroup's interface, so the ranks' code does not care which it runs on.

What goes where:

- ``all_reduce_`` and ``gather``: the backend's collectives on the ranks' own tensors, on the GPU with
  NCCL (rank r on cuda:<first>+r). Every rank gets the same sum (a ring or tree reduces each element
  once and sends that result to all).
- ``broadcast`` (the step's plan), ``barrier`` and the supervision (``watch``, ``fail``, ``failed_rank``,
  dead peers, rank 0's deadline): a ShmGroup on this host, the *control* group. Ranks >= 1 wait for
  the next plan as long as the server is idle, for hours, but a torch.distributed collective has one
  timeout for all of its ops (gloo raises, NCCL's watchdog aborts the process); an NCCL broadcast
  would also keep a kernel spinning on each idle GPU and cost two device-to-host copies a step (the
  size, then the bytes), and over gloo it is two TCP round trips where shared memory is one
  semaphore post (scripts/bench_allreduce.py --backend gloo measures both). The control group
  waits without a deadline on ranks >= 1 while rank 0 lives and with the group's deadline on rank
  0; the backend's collectives run only inside a step, when every rank is in it, under the same
  timeout (``timeout_s``).

Rendezvous: rank 0 starts a TCPStore on 127.0.0.1, on a port the OS picks, which ``spec`` carries. The
backend connects in the group's first ``barrier`` -- the ranks' "loaded" -- so a rank that dies while
it loads its shard for minutes is seen at once by the control group's pid checks, not by a
rendezvous waiting out its timeout. At world 1 the backend still runs every collective (one GPU can
test the NCCL path).

Failures: a backend collective that raises (gloo: the dead peer's socket closed, or the timeout
passed) marks the group failed and raises RankDied, naming the dead peer when there is one. ``fail``
-- RankProcesses' watchdog calls it when a rank process exits -- also aborts an NCCL communicator, so
that kernels waiting for the dead rank end and rank 0's step returns (stepper/tp.py then refuses its
result).
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ipc.collective import WAIT_SLICE_S, RankDied, ShmGroup, check_tensor

BACKENDS = ("gloo", "nccl")
SPEC_PREFIX = "dist:"
HOST = "127.0.0.1"
DEAD_PEER_S = 1.0          # after a backend error, how long to look for the peer whose death caused it


class DistGroup:
    """``world`` processes on one host: tensors over a torch.distributed backend, plans and supervision
    over a ShmGroup."""

    rank: int
    world: int
    spec: str

    def __init__(self, control: ShmGroup, backend: str, port: int, first_device: int,
                 store: dist.TCPStore | None = None):
        self.control, self.backend = control, backend
        self.rank, self.world = control.rank, control.world
        self.max_bytes, self.timeout_s = control.max_bytes, control.timeout_s
        self.device = torch.device("cuda", first_device + self.rank) if backend == "nccl" else torch.device("cpu")
        self.spec = f"{SPEC_PREFIX}{backend},{port},{first_device}|{control.spec}"
        self._port = port
        self._store = store                 # rank 0's, the rendezvous server; the others' once connected
        self.process_group: dist.ProcessGroup | None = None     # connected in the first barrier
        self._backend = None
        self._aborted = False
        self._closed = False
        self._sum = dist.AllreduceOptions()
        self._sum.reduceOp = dist.ReduceOp.SUM

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def create(cls, world: int, max_bytes: int, backend: str, timeout_s: float = 30.0,
               first_device: int = 0) -> DistGroup:
        """Rank 0. ``max_bytes`` bounds one all-reduce's tensor, one broadcast and one gather part, as
        ShmGroup's does; NCCL ranks use cuda:first_device.. in rank order."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown torch.distributed backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        available = dist.is_available() and (dist.is_nccl_available() if backend == "nccl"
                                             else dist.is_gloo_available())
        if not available:
            raise ValueError(f"this torch ({torch.__version__}) was built without the {backend} backend")
        control = ShmGroup.create(world, max_bytes, timeout_s)
        try:
            store = dist.TCPStore(HOST, 0, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                                  wait_for_workers=False)
            return cls(control, backend, store.port, first_device, store)
        except BaseException:
            control.close()
            raise

    @classmethod
    def attach(cls, spec: str, rank: int) -> DistGroup:
        """A rank >= 1 joins the group rank 0 created (``spec`` is rank 0's ``.spec``)."""
        try:
            head, control_spec = spec.removeprefix(SPEC_PREFIX).split("|", 1)
            backend, port, first_device = head.split(",")
            port, first_device = int(port), int(first_device)
        except ValueError:
            raise ValueError(f"not a DistGroup spec: {spec!r}") from None
        if not spec.startswith(SPEC_PREFIX) or backend not in BACKENDS:
            raise ValueError(f"not a DistGroup spec: {spec!r}")
        return cls(ShmGroup.attach(control_spec, rank), backend, port, first_device)

    def _connect(self) -> None:
        """Every rank at once, after the control group's first barrier: the backend's rendezvous."""
        timeout = timedelta(seconds=self.timeout_s)
        if self._store is None:
            self._store = dist.TCPStore(HOST, self._port, self.world, is_master=False, timeout=timeout)
        if self.backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
            backend = dist.ProcessGroupGloo(self._store, self.rank, self.world, options)
            kind = dist.ProcessGroup.BackendType.GLOO
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend = dist.ProcessGroupNCCL(self._store, self.rank, self.world, options)
            kind = dist.ProcessGroup.BackendType.NCCL
        group = dist.ProcessGroup(self._store, self.rank, self.world)
        group._set_default_backend(kind)
        group._register_backend(torch.device(self.device.type), kind, backend)
        if self.backend == "nccl":
            backend.eager_connect_single_device(self.device)    # the communicator now, not in the first step
        self._backend, self.process_group = backend, group

    # -- supervision (the control group's) --------------------------------------------------------

    @property
    def prefix(self) -> str:
        return self.control.prefix

    def watch(self, pids: dict[int, int]) -> None:
        self.control.watch(pids)

    def fail(self, rank: int, deadline: bool = False) -> None:
        """Mark the group failed because of ``rank``; an NCCL communicator is aborted, so that kernels
        waiting for that rank end (called from RankProcesses' watchdog thread)."""
        self.control.fail(rank, deadline)
        if self.backend == "nccl" and self._backend is not None and not self._aborted:
            self._aborted = True
            try:
                self._backend.abort()
            except RuntimeError:
                pass              # already torn down: nothing waits on it

    @property
    def failed_rank(self) -> int | None:
        return self.control.failed_rank

    # -- collectives --------------------------------------------------------------------------------

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """In place, the sum over ranks of a contiguous float32/bfloat16/float16 tensor on this rank's
        device of at most max_bytes; the same result on every rank. With NCCL it is queued on the
        device: the host goes on at once."""
        check_tensor(t, "all_reduce_", self.device, self.max_bytes)
        self._run(lambda: self.process_group.allreduce([t], self._sum))
        return t

    def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0 passes bytes (the step plan, at most max_bytes), the others None: over the control group."""
        return self.control.broadcast(payload)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0 gets every rank's tensor (same shape on each), the others None."""
        check_tensor(t, "gather", self.device, self.max_bytes)
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [[torch.empty_like(t) for _ in range(self.world)]] if self.rank == 0 else []
        self._run(lambda: self.process_group.gather(parts, [t], options))
        return parts[0] if self.rank == 0 else None

    def barrier(self, timeout_s: float | None = None) -> None:
        """Until every rank is here (over the control group); the first one connects the backend."""
        self.control.barrier(timeout_s)
        if self.process_group is None:
            try:
                self._connect()
            except RuntimeError as e:
                raise self._backend_failed(e) from None

    def _run(self, op) -> None:
        if self._closed:
            raise RuntimeError("the group is closed")
        self.control.check_usable()
        if self.process_group is None:
            raise RuntimeError("the backend connects in the group's first barrier (the ranks' ready)")
        try:
            op().wait()
        except RuntimeError as e:        # DistBackendError, DistNetworkError: a peer died or timed out
            raise self._backend_failed(e) from None

    def _backend_failed(self, error: RuntimeError) -> RankDied:
        """The group failed; the RankDied to raise, naming the rank that caused it where one is known."""
        if self.control.failed_rank is None:
            # a peer's socket closes as it dies, a moment before its pid is gone
            deadline = time.monotonic() + DEAD_PEER_S
            while (dead := self.control.dead_peer()) is None and time.monotonic() < deadline:
                time.sleep(WAIT_SLICE_S / 5)
            if dead is not None:
                self.fail(dead[0])
                return RankDied(f"tensor-parallel rank {dead[0]} (pid {dead[1]}) died ({self.backend}: {error})")
            # no peer died: one stopped answering within the backend's timeout (at world 2, the other)
            self.fail(next(r for r in range(self.world) if r != self.rank) if self.world > 1 else 0, deadline=True)
            return RankDied(f"a tensor-parallel {self.backend} collective failed: {error}")
        try:
            self.control.check_usable()
        except RankDied as e:
            return e
        return RankDied(str(error))

    # -- shutdown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Rank 0 closes the control group (waiting ranks raise GroupClosed) and its names; the backend
        goes (an NCCL communicator shut down, or aborted where the group failed)."""
        if self._closed:
            return
        self._closed = True
        backend, failed = self._backend, self.control.failed_rank is not None
        self._backend = self.process_group = self._store = None
        if backend is not None and self.backend == "nccl" and not self._aborted:
            try:
                backend.abort() if failed else backend.shutdown()
            except RuntimeError:
                pass
        self.control.close()

    def __enter__(self) -> DistGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def create_group(backend: str, world: int, max_bytes: int, timeout_s: float = 30.0,
                 first_device: int = 0) -> ShmGroup | DistGroup:
    """Rank 0's group: ``shm`` (ShmGroup, CPU ranks), ``gloo`` or ``nccl`` (DistGroup)."""
    if backend == "shm":
        return ShmGroup.create(world, max_bytes, timeout_s)
    return DistGroup.create(world, max_bytes, backend, timeout_s, first_device)


def attach_group(spec: str, rank: int) -> ShmGroup | DistGroup:
    """A rank >= 1 joins rank 0's group, whichever kind its spec names."""
    return DistGroup.attach(spec, rank) if spec.startswith(SPEC_PREFIX) else ShmGroup.attach(spec, rank)
