"""ShmGroup: collectives of tensor-parallel ranks on one host over POSIX shared memory and semaphores.

One segment holds a control header (global flags, then one 128-byte line per rank: its phase counter,
pid and the size of what it wrote) and two sets of data slots, ``max_bytes`` per rank each. Collective
number n uses set n % 2, so a rank may write the next collective's data while a slower peer still
reads this one's; before writing set n % 2 again a rank makes sure every peer has started collective
n-1, i.e. finished reading collective n-2 (almost always already known, so no extra wait).

Synchronisation is one counted arrival per phase: a rank bumps its phase counter and posts one
semaphore per peer (``sem[receiver][sender]``, so every post is accounted to exactly one arrival).
A waiter first spins for ``spin_s`` on the peer's counter (a futex wake-up costs tens of
microseconds; a peer that is about to arrive is cheaper to watch), then sleeps on the semaphore in
WAIT_SLICE_S slices. The semaphore post is always consumed: it orders the peer's writes before our
reads on any architecture and keeps the count exact. Between slices a wait looks at the group's
flags (closed, failed), the watched peers' pids and, on rank 0, its deadline: a dead, stopped or
lost peer raises RankDied instead of a hang, and marks the group failed so every other rank's wait
raises too.

Deadlines are rank 0's business: rank 0 drives the steps and every other rank waits for it (an idle
server sends no plan for hours), so ranks >= 1 wait as long as rank 0 lives and the group is neither
failed nor closed.

all_reduce_ sums in a fixed rank order in float32 and rounds once, so every rank's result is the same
bit for bit. Below ``split_bytes`` every rank sums the whole tensor from all slots (one phase); above,
rank r sums only its share and writes it back into its own slot (reduce-scatter), then every rank
copies the shares (all-gather): two phases, but each rank reads about 2x the tensor instead of world x.
Two ranks read as much either way, so they always take one phase; from three ranks, tensors of
SPLIT_BYTES and more are split.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import posix_ipc
import torch

from ipc import names

WAIT_SLICE_S = 0.05        # how often a sleeping wait looks at its peers, the flags and its deadline
SPIN_US = 50.0             # default spin on the peer's counter before sleeping (scripts/bench_allreduce.py)
SPLIT_BYTES = 256 << 10    # from this size, 3+ ranks reduce-scatter then all-gather (see split_bytes)
PAGE = 4096
CHUNK_ALIGN = 64           # reduce-scatter shares start on cache lines
MAGIC = 0x41535450         # "ASTP"

DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPE = {code: dtype for dtype, code in DTYPE_CODE.items()}

# control header: int64 words. Global words first, then one LINE-word line per rank.
_MAGIC, _WORLD, _MAX_BYTES, _CLOSED, _FAILED, _FAIL_DEADLINE = range(6)
LINE = 16                  # 128 bytes: a rank's line never shares a (prefetched pair of) cache line(s)
_ARRIVED, _PID, _NBYTES, _DTYPE = 0, 1, 2, 4     # _NBYTES and _DTYPE take one word per data set (2)


def check_tensor(t: torch.Tensor, op: str, device: torch.device, max_bytes: int) -> None:
    """What a group's all_reduce_ / gather take: a contiguous float tensor on the group's device that
    fits its max_bytes (a clear ValueError otherwise, before any rank is waited on)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op} takes a torch.Tensor, not {type(t).__name__}")
    if t.dtype not in DTYPE_CODE:
        raise ValueError(f"{op} takes float32, bfloat16 or float16 tensors, not {t.dtype}")
    if t.device != device:
        raise ValueError(f"{op} takes tensors on {device}, not {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{op} takes contiguous tensors")
    if t.nbytes > max_bytes:
        raise ValueError(f"{op} of {t.nbytes} B ({tuple(t.shape)} {t.dtype}) exceeds the group's "
                         f"max_bytes {max_bytes}")


class RankDied(RuntimeError):
    """A peer process died, or a wait passed its deadline: the group is unusable (never a hang)."""


class GroupClosed(RankDied):
    """Rank 0 closed the group while this rank waited (the server is shutting down)."""


class ShmGroup:
    """``world`` processes on one host: collectives over one shared segment + semaphores."""

    rank: int
    world: int
    spec: str
    device = torch.device("cpu")          # where the tensors of its collectives live

    def __init__(self, prefix: str, world: int, rank: int, max_bytes: int, timeout_s: float, spin_us: float,
                 create: bool):
        self.prefix, self.world, self.rank = prefix, world, rank
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.spin_s = spin_us * 1e-6
        # two ranks read as much either way and the split adds a phase: one phase always won for world 2
        # (scripts/bench_allreduce.py); from three ranks up the one-phase sum reads world x the tensor
        self.split_bytes = SPLIT_BYTES if world > 2 else 1 << 62
        self.spec = f"{prefix},{world},{max_bytes},{timeout_s!r},{spin_us!r}"
        self._owner = create
        self._seg_name = prefix + "-tp"
        self._header_bytes = _align(LINE * 8 * (world + 1), PAGE)
        self._slot_bytes = _align(max(max_bytes, 1), PAGE)
        size = self._header_bytes + 2 * world * self._slot_bytes
        self._sem_names: list[str] = []
        self._buf = names.create_shm(self._seg_name, size) if create else names.attach_shm(self._seg_name)
        try:
            self._mem = memoryview(self._buf)
            self._ctl = self._mem[:self._header_bytes].cast("q")
            if create:
                self._ctl[_WORLD], self._ctl[_MAX_BYTES] = world, max_bytes
                self._ctl[_MAGIC] = MAGIC
                for receiver in range(world):
                    for sender in range(world):
                        if receiver != sender:
                            sem = names.create_sem(self._sem_name(receiver, sender))
                            self._sem_names.append(sem.name)
                            sem.close()
            elif (self._ctl[_MAGIC], self._ctl[_WORLD], self._ctl[_MAX_BYTES]) != (MAGIC, world, max_bytes):
                raise ValueError(f"segment {self._seg_name} does not hold a group of {world} x {max_bytes} B")
            peers = [r for r in range(world) if r != rank]
            # recv[j]: posts from peer j (one per phase it arrives at); send[j]: our posts to peer j
            self._recv = {j: posix_ipc.Semaphore(self._sem_name(rank, j)) for j in peers}
            self._send = {j: posix_ipc.Semaphore(self._sem_name(j, rank)) for j in peers}
        except BaseException:
            self._release_maps()
            if create:
                self._unlink_all()
            raise
        self._peers = peers
        self._seen = {j: 0 for j in peers}        # posts consumed from peer j = phases of j known arrived
        self._phase = 0                           # phases this rank has arrived at
        self._op = 0                              # collectives begun (data set = op % 2)
        self._prev_op_phase = 0                   # the first phase of the previous collective
        self._watched: dict[int, int] = {}
        self._closed = False
        self._ctl[self._line(rank) + _PID] = os.getpid()
        # flat views of every data slot per dtype: _slots[set][rank][dtype] (the storage is shared)
        self._slots = []
        for data_set in range(2):
            row = []
            for r in range(world):
                raw = torch.frombuffer(self._buf, dtype=torch.uint8, count=self._slot_bytes,
                                       offset=self._slot_offset(data_set, r))
                row.append({dtype: raw.view(dtype) for dtype in DTYPE_CODE})
            self._slots.append(row)
        self._slot_views: dict[tuple[int, torch.dtype, int], list[torch.Tensor]] = {}
        self._acc: torch.Tensor | None = None     # float32 scratch for 16-bit sums over 3+ ranks
        self._shares: dict[tuple[int, int], list[tuple[int, int]]] = {}

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def create(cls, world: int, max_bytes: int, timeout_s: float = 30.0, spin_us: float = SPIN_US) -> ShmGroup:
        """Rank 0 (the server's stepper). Owns and later unlinks every name. ``.spec`` is a str to give to
        the other ranks. ``max_bytes`` bounds one all-reduce's tensor, one broadcast and one gather part."""
        if world < 1:
            raise ValueError(f"a group needs at least one rank, not {world}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, not {max_bytes}")
        if timeout_s <= 0 or spin_us < 0:
            raise ValueError(f"timeout_s must be positive and spin_us not negative ({timeout_s}, {spin_us})")
        return cls(names.new_prefix(), world, 0, max_bytes, timeout_s, spin_us, create=True)

    @classmethod
    def attach(cls, spec: str, rank: int) -> ShmGroup:
        """A rank >= 1 joins the group rank 0 created (``spec`` is rank 0's ``.spec``)."""
        try:
            prefix, world, max_bytes, timeout_s, spin_us = spec.split(",")
            world, max_bytes, timeout_s, spin_us = int(world), int(max_bytes), float(timeout_s), float(spin_us)
        except ValueError:
            raise ValueError(f"not a ShmGroup spec: {spec!r}") from None
        if not 1 <= rank < world:
            raise ValueError(f"rank {rank} is not one of the group's ranks 1..{world - 1}")
        return cls(prefix, world, rank, max_bytes, timeout_s, spin_us, create=False)

    def _sem_name(self, receiver: int, sender: int) -> str:
        return f"{self.prefix}-tp{receiver}.{sender}"

    def _slot_offset(self, data_set: int, rank: int) -> int:
        return self._header_bytes + (data_set * self.world + rank) * self._slot_bytes

    @staticmethod
    def _line(rank: int) -> int:
        return LINE * (rank + 1)

    # -- supervision ------------------------------------------------------------------------------

    def watch(self, pids: dict[int, int]) -> None:
        """rank -> pid of the peers to watch: a wait that sees one of them dead raises RankDied at once.
        (Every rank also watches the pids its peers wrote into the header when they attached.)"""
        self._watched.update({r: pid for r, pid in pids.items() if r != self.rank})

    def fail(self, rank: int, deadline: bool = False) -> None:
        """Mark the group failed because of ``rank`` (the first cause is kept): every wait raises RankDied."""
        if not self._closed and not self._ctl[_FAILED]:
            self._ctl[_FAIL_DEADLINE] = int(deadline)
            self._ctl[_FAILED] = rank + 1

    @property
    def failed_rank(self) -> int | None:
        """The rank the group failed because of (a death or a missed deadline), None while healthy."""
        failed = self._ctl[_FAILED]
        return failed - 1 if failed else None

    def _failure(self) -> RankDied:
        rank = self._ctl[_FAILED] - 1
        why = f"missed a deadline of {self.timeout_s:g} s" if self._ctl[_FAIL_DEADLINE] else "died"
        return RankDied(f"tensor-parallel rank {rank} {why}; the group is unusable")

    def check_usable(self) -> None:
        """Raise unless the group can run a collective: closed (RuntimeError), failed (RankDied), or on
        ranks >= 1 closed by rank 0 (GroupClosed)."""
        if self._closed:
            raise RuntimeError("the group is closed")
        if self._ctl[_FAILED]:
            raise self._failure()
        if self.rank and self._ctl[_CLOSED]:
            raise GroupClosed("rank 0 closed the tensor-parallel group")

    def _check_peers(self, waiting_for: int, deadline: float | None) -> None:
        """Between sleeps: raise RankDied if the group failed or closed, a peer is dead, or rank 0's
        deadline passed (marking the group failed, so that every other rank stops too)."""
        self.check_usable()
        dead = self.dead_peer()
        if dead is not None:
            self.fail(dead[0])
            raise RankDied(f"tensor-parallel rank {dead[0]} (pid {dead[1]}) died")
        if deadline is not None and time.monotonic() >= deadline:
            self.fail(waiting_for, deadline=True)
            raise RankDied(f"tensor-parallel rank {waiting_for} did not arrive within {self.timeout_s:g} s")

    def dead_peer(self) -> tuple[int, int] | None:
        """(rank, pid) of a peer that is no longer alive (by the pids the peers wrote when they attached,
        and those watched), None while all live."""
        pids = {r: self._ctl[self._line(r) + _PID] for r in self._peers}
        pids.update(self._watched)
        for r, pid in pids.items():
            if pid and not names.pid_alive(pid):
                return r, pid
        return None

    # -- phases -----------------------------------------------------------------------------------

    def _arrive(self) -> int:
        """Announce that this rank reached its next phase (after writing what the phase shares)."""
        self._phase += 1
        self._ctl[self._line(self.rank) + _ARRIVED] = self._phase
        for sem in self._send.values():
            sem.release()
        return self._phase

    def _wait(self, peer: int, phase: int, deadline: float | None) -> None:
        """Until ``peer`` has arrived at ``phase`` (consuming its posts up to there)."""
        if self._seen[peer] >= phase:
            return
        if self.spin_s:
            counter = self._line(peer) + _ARRIVED
            end = time.perf_counter() + self.spin_s
            while self._ctl[counter] < phase and time.perf_counter() < end:
                pass
        sem = self._recv[peer]
        while self._seen[peer] < phase:
            try:
                sem.acquire(WAIT_SLICE_S)
            except posix_ipc.BusyError:
                self._check_peers(peer, deadline)
                continue
            self._seen[peer] += 1

    def _wait_all(self, phase: int, timeout_s: float | None = None) -> None:
        deadline = None
        if self.rank == 0:
            deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        for peer in self._peers:
            self._wait(peer, phase, deadline)

    def _begin(self, writes: bool) -> int:
        """Start a collective; returns its data set. One that writes data first waits until every peer
        has started the previous collective (so none still reads this data set's last contents)."""
        self.check_usable()
        if writes and self._prev_op_phase:
            self._wait_all(self._prev_op_phase)
        self._prev_op_phase = self._phase + 1
        self._op += 1
        return self._op % 2

    def _publish(self, data_set: int, nbytes: int, dtype_code: int) -> None:
        line = self._line(self.rank)
        self._ctl[line + _NBYTES + data_set] = nbytes
        self._ctl[line + _DTYPE + data_set] = dtype_code

    def _published(self, data_set: int, rank: int) -> tuple[int, int]:
        line = self._line(rank)
        return self._ctl[line + _NBYTES + data_set], self._ctl[line + _DTYPE + data_set]

    # -- collectives ------------------------------------------------------------------------------

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """In place, the sum over ranks of a contiguous float32/bfloat16/float16 CPU tensor of at most
        max_bytes. Every rank gets bit-identical results (sum in a fixed rank order, in float32,
        rounded once)."""
        check_tensor(t, "all_reduce_", self.device, self.max_bytes)
        if self.world == 1:
            return t
        n = t.numel()
        flat = t.view(-1)                 # [n]
        data_set = self._begin(writes=True)
        slots = self._views(data_set, t.dtype, n)
        slots[self.rank].copy_(flat)
        self._publish(data_set, t.nbytes, DTYPE_CODE[t.dtype])
        self._wait_all(self._arrive())
        self._check_same(data_set, t.nbytes, DTYPE_CODE[t.dtype], "all_reduce_")
        if t.nbytes < self.split_bytes:
            self._sum_into(flat, slots)
        else:
            shares = self._share_bounds(n, t.element_size())
            lo, hi = shares[self.rank]
            mine = flat[lo:hi]
            self._sum_into(mine, [s[lo:hi] for s in slots])
            slots[self.rank][lo:hi].copy_(mine)       # our share of the sum, for the others to copy
            self._wait_all(self._arrive())
            for r, (lo, hi) in enumerate(shares):
                if r != self.rank:
                    flat[lo:hi].copy_(slots[r][lo:hi])
        return t

    def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0 passes bytes (at most max_bytes), the others pass None and get them (the step plan).
        Only rank 0 waits on a deadline: the others wait for rank 0 as long as it lives."""
        if self.rank == 0:
            if payload is None:
                raise ValueError("rank 0 broadcasts bytes, not None")
            payload = bytes(payload)
            if len(payload) > self.max_bytes:
                raise ValueError(f"broadcast of {len(payload)} B exceeds the group's max_bytes {self.max_bytes}")
            data_set = self._begin(writes=True)
            offset = self._slot_offset(data_set, 0)
            self._mem[offset:offset + len(payload)] = payload
            self._publish(data_set, len(payload), 0)
            self._arrive()
            return payload
        if payload is not None:
            raise ValueError(f"rank {self.rank} receives a broadcast: pass None")
        data_set = self._begin(writes=False)
        phase = self._arrive()
        self._wait(0, phase, None)
        nbytes, _ = self._published(data_set, 0)
        offset = self._slot_offset(data_set, 0)
        return bytes(self._mem[offset:offset + nbytes])

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0 gets every rank's tensor (same shape on each; copies), others get None. Small tensors."""
        check_tensor(t, "gather", self.device, self.max_bytes)
        data_set = self._begin(writes=True)
        slots = self._views(data_set, t.dtype, t.numel())
        slots[self.rank].copy_(t.view(-1))
        self._publish(data_set, t.nbytes, DTYPE_CODE[t.dtype])
        phase = self._arrive()
        if self.rank != 0:
            return None
        self._wait_all(phase)
        self._check_same(data_set, t.nbytes, DTYPE_CODE[t.dtype], "gather")
        return [t.clone() if r == 0 else slot.view(t.shape).clone() for r, slot in enumerate(slots)]

    def barrier(self, timeout_s: float | None = None) -> None:
        """Until every rank is here. ``timeout_s`` overrides rank 0's deadline (e.g. while ranks load)."""
        self._begin(writes=False)
        self._wait_all(self._arrive(), timeout_s)

    # -- helpers ----------------------------------------------------------------------------------

    def _check_same(self, data_set: int, nbytes: int, code: int, op: str) -> None:
        """Every rank raises the same ValueError (and stays in step) when the ranks' tensors differ."""
        seen = [self._published(data_set, r) for r in range(self.world)]
        if any(s != (nbytes, code) for s in seen):
            sizes = ", ".join(f"rank {r}: {b} B {CODE_DTYPE[c]}" for r, (b, c) in enumerate(seen))
            raise ValueError(f"{op} needs the same size and dtype on every rank ({sizes})")

    def _views(self, data_set: int, dtype: torch.dtype, n: int) -> list[torch.Tensor]:
        """[n]-element views of every rank's slot in a data set (kept: a step repeats a few sizes)."""
        key = (data_set, dtype, n)
        views = self._slot_views.get(key)
        if views is None:
            if len(self._slot_views) >= 256:
                self._slot_views.clear()
            views = self._slot_views[key] = [row[dtype][:n] for row in self._slots[data_set]]
        return views

    def _sum_into(self, out: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """out = parts[0] + parts[1] + ... in that order, in float32, rounded once into out's dtype."""
        if out.dtype == torch.float32:
            torch.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                out.add_(part)
        elif len(parts) == 2:
            torch.add(parts[0], parts[1], out=out)    # 16-bit add: widened to float32, rounded once
        else:
            if self._acc is None:
                self._acc = torch.empty(self.max_bytes // 2, dtype=torch.float32)
            acc = self._acc[:out.numel()]
            acc.copy_(parts[0])
            for part in parts[1:]:
                acc.add_(part)
            out.copy_(acc)

    def _share_bounds(self, n: int, element_size: int) -> list[tuple[int, int]]:
        """Each rank's [lo, hi) of an n-element reduction, split evenly in cache lines."""
        key = (n, element_size)
        if key not in self._shares:
            unit = CHUNK_ALIGN // element_size
            lines = -(-n // unit)
            bounds, lo = [], 0
            for r in range(self.world):
                hi = min(n, lo + (lines // self.world + (r < lines % self.world)) * unit)
                bounds.append((lo, hi))
                lo = hi
            self._shares[key] = bounds
        return self._shares[key]

    # -- shutdown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Rank 0 marks the group closed (waiting ranks raise GroupClosed) and unlinks every name; the
        others detach."""
        if self._closed:
            return
        self._closed = True
        if self._owner:
            self._ctl[_CLOSED] = 1
        for sem in (*self._recv.values(), *self._send.values()):
            sem.close()
        self._release_maps()
        if self._owner:
            self._unlink_all()

    def _release_maps(self) -> None:
        self._slots, self._slot_views, self._acc = [], {}, None
        for view in ("_ctl", "_mem"):
            if hasattr(self, view):
                getattr(self, view).release()
        names.close_map(self._buf)

    def _unlink_all(self) -> None:
        names.unlink(self._seg_name)
        for name in self._sem_names:
            names.unlink(name)

    def __enter__(self) -> ShmGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


# -- pinning ----------------------------------------------------------------------------------------

NODE_DIR = Path("/sys/devices/system/node")


def cores_for_ranks(world: int, spec: str | None = None, *, node_dir: Path = NODE_DIR,
                    allowed: set[int] | None = None) -> list[list[int]]:
    """The CPUs of each rank: from an explicit ``"0-3;4-7"`` spec (one group per rank, the --tp-cores
    flag), else one or more whole NUMA nodes per rank when there are at least ``world`` nodes with
    allowed CPUs, else the allowed CPUs (os.sched_getaffinity) split evenly in order."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    if world < 1:
        raise ValueError(f"a group needs at least one rank, not {world}")
    if spec is not None:
        groups = [parse_cpulist(part, what="--tp-cores") for part in spec.split(";")]
        if len(groups) != world:
            raise ValueError(f"--tp-cores {spec!r} names {len(groups)} CPU groups for {world} ranks "
                             "(one group per rank, separated by ';')")
        used: set[int] = set()
        for rank, group in enumerate(groups):
            if not group:
                raise ValueError(f"--tp-cores {spec!r}: rank {rank} has no CPUs")
            if not set(group) <= allowed:
                raise ValueError(f"--tp-cores {spec!r}: CPUs {sorted(set(group) - allowed)} are not available to "
                                 f"this process (it may use {_cpulist(sorted(allowed))})")
            if used & set(group):
                raise ValueError(f"--tp-cores {spec!r}: CPUs {sorted(used & set(group))} are given to two ranks")
            used |= set(group)
        return groups
    nodes = []
    for path in sorted(node_dir.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = sorted(set(parse_cpulist(path.joinpath("cpulist").read_text(), what=str(path))) & allowed)
        except OSError:
            continue
        if cpus:
            nodes.append(cpus)
    if len(nodes) >= world:
        return [sum(part, []) for part in _split(nodes, world)]
    if len(allowed) < world:
        raise ValueError(f"{world} tensor-parallel ranks need at least {world} CPUs; this process may use "
                         f"{len(allowed)} ({_cpulist(sorted(allowed))})")
    return _split(sorted(allowed), world)


def parse_cpulist(text: str, what: str = "CPU list") -> list[int]:
    """``"0-3,8,10-11"`` (the kernel's cpulist format) -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for item in text.strip().split(","):
        if not item:
            continue
        first, _, last = item.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"{what}: {item!r} is not a CPU number or range like 4-7") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"{what}: {item!r} is not a CPU range (first <= last, both >= 0)")
        cpus.extend(range(lo, hi + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{what}: {text.strip()!r} names a CPU twice")
    return cpus


def _split(items: list, parts: int) -> list[list]:
    """items in ``parts`` contiguous runs whose lengths differ by at most one (longer first)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(items[start:end])
        start = end
    return out


def _cpulist(cpus: list[int]) -> str:
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
