"""ipc/collective.py, ipc/dist.py and ipc/ranks.py: all-reduce against a float64 sum on every rank (and,
over shared memory, an exact float32 fixed-order sum), broadcast, gather, bad input, ranks dying or
hanging (RankDied, never a hang), the pinning helper, and /dev/shm left clean; the ShmGroup and the
DistGroup over gloo. The other ranks are tests/collective_rank.py processes; every process started
here is killed or stopped here, by pid."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import collective_rank as cr
from ipc import cleanup_stale, leftovers
from ipc.collective import RankDied, ShmGroup, cores_for_ranks, parse_cpulist
from ipc.dist import DistGroup, create_group
from ipc.names import pid_alive
from ipc.ranks import RankProcesses

TESTS = Path(__file__).resolve().parent
START_S = 120        # ranks import torch on a loaded 2-core machine

pytestmark = pytest.mark.timeout(180)


@contextmanager
def ranks_of(world: int, scenario: str, out: Path, sleeper: int | None = None, timeout_s: float = 30.0,
             on_death=None, backend: str = "shm"):
    """A group of ``world`` ranks, this process rank 0, the others tests/collective_rank.py; on the way out
    every rank process is gone and nothing of the group is left in /dev/shm."""
    group = create_group(backend, world, cr.MAX_BYTES, timeout_s=timeout_s)
    args = [scenario, str(out)] + ([str(sleeper)] if sleeper is not None else [])
    ranks = RankProcesses(group, "collective_rank", args, env={"PYTHONPATH": str(TESTS)}, on_death=on_death)
    try:
        ranks.wait_ready(START_S)
        yield group, ranks
    finally:
        ranks.close()
        assert not [pid for pid in ranks.pids.values() if pid_alive(pid)]
        assert leftovers(group.prefix) == []


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.01)


def float32_sum(world: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The group's contract: ranks' tensors summed in rank order in float32, rounded once."""
    acc = cr.data(0, n, dtype).float()
    for r in range(1, world):
        acc = acc + cr.data(r, n, dtype).float()
    return acc.to(dtype)


@pytest.mark.parametrize("backend, world", [("shm", 2), ("shm", 3), ("gloo", 2), ("gloo", 3)])
def test_collectives_against_references(backend, world, tmp_path):
    with ranks_of(world, "script", tmp_path, backend=backend) as (group, _):
        results = [cr.script(group)]
        group.barrier()                        # the other ranks saved theirs
    results += [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(1, world)]   # ours: bytes too
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
    for dtype in cr.DTYPES:
        for n in cr.sizes(dtype):
            key = f"reduce {dtype} {n}"
            expected = float32_sum(world, n, dtype)
            parts = [cr.data(r, n, dtype).double() for r in range(world)]
            exact = sum(parts)
            # each of the world - 1 additions rounds once, by at most half an ulp of its partial sum
            bound = (world - 1) * torch.finfo(dtype).eps * sum(p.abs() for p in parts)
            for rank, out in enumerate(results):
                assert out[key].dtype == dtype and out[key].shape == (n,)
                assert torch.equal(out[key], results[0][key]), f"rank {rank}: {key} differs from rank 0's"
                assert bool(((out[key].double() - exact).abs() <= bound).all()), f"rank {rank}: {key}"
                if backend == "shm":           # ShmGroup's contract: in rank order in float32, rounded once
                    assert torch.equal(out[key], expected), f"rank {rank}: {key}"
                    torch.testing.assert_close(out[key].double(), exact, rtol=tolerance[dtype],
                                               atol=tolerance[dtype])
    for rank, out in enumerate(results):
        assert out["too big"] == (5 if rank == 0 else 3)
        assert torch.equal(out["after too big"], float32_sum(world, 5, torch.float32))
        for size in cr.PLAN_SIZES:
            assert out[f"plan {size}"] == cr.plan(size)
        assert out["plan after too big"] == b"go"
    gathered = results[0]["gather"]
    assert [g.shape for g in gathered] == [(3, 37)] * world
    assert all(torch.equal(g, cr.gather_part(r)) for r, g in enumerate(gathered))
    assert all(out["gather"] is None for out in results[1:])


def test_bad_input_is_a_value_error_before_any_exchange():
    """No peer is attached: a call that got as far as an exchange would wait (and fail on its deadline)."""
    group = ShmGroup.create(2, 4096, timeout_s=1.0)
    try:
        bad_tensors = [torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.float64),
                       torch.zeros(4, dtype=torch.bool), torch.zeros(8, 8).t(), torch.zeros(8, 8)[:, ::2],
                       torch.zeros(1).expand(16), torch.zeros(1025), torch.zeros(2049, dtype=torch.bfloat16),
                       torch.zeros(64, 64), [1.0, 2.0]]
        for t in bad_tensors:
            with pytest.raises(ValueError):
                group.all_reduce_(t)
            with pytest.raises(ValueError):
                group.gather(t)
        for payload in (None, bytes(4097), bytes(1 << 20)):
            with pytest.raises(ValueError):
                group.broadcast(payload)
        for spec in ("", "nonsense", group.spec.rsplit(",", 1)[0], group.spec.replace(",2,", ",two,")):
            with pytest.raises(ValueError):
                ShmGroup.attach(spec, 1)
        for rank in (-1, 0, 2, 5):
            with pytest.raises(ValueError):
                ShmGroup.attach(group.spec, rank)
        for world, max_bytes, timeout_s in ((0, 4096, 1.0), (2, 0, 1.0), (2, 4096, 0.0), (-1, 1, 1.0)):
            with pytest.raises(ValueError):
                ShmGroup.create(world, max_bytes, timeout_s)
        with ShmGroup.create(1, 64) as alone:     # a world of one: every collective is local
            t = torch.arange(16, dtype=torch.float32)
            assert torch.equal(alone.all_reduce_(t), torch.arange(16, dtype=torch.float32))
            assert alone.broadcast(b"plan") == b"plan"
            assert torch.equal(alone.gather(t)[0], t)
            alone.barrier()
    finally:
        group.close()
    assert leftovers(group.prefix) == []
    with pytest.raises(RuntimeError):
        group.barrier()


def test_dist_group_bad_input_and_a_world_of_one():
    """gloo: bad tensors and sizes are a ValueError before any exchange (no peer ever attaches); the backend
    connects in the first barrier, so a collective before it is refused; a world of one runs every
    collective through the backend; bad specs and ranks do not attach; /dev/shm is left clean."""
    group = DistGroup.create(2, 4096, "gloo", timeout_s=1.0)
    try:
        bad_tensors = [torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.float64),
                       torch.zeros(8, 8).t(), torch.zeros(1).expand(16), torch.zeros(1025),
                       torch.zeros(2049, dtype=torch.bfloat16), [1.0, 2.0]]
        for t in bad_tensors:
            with pytest.raises(ValueError):
                group.all_reduce_(t)
            with pytest.raises(ValueError):
                group.gather(t)
        with pytest.raises(RuntimeError, match="first barrier"):
            group.all_reduce_(torch.zeros(4))
        for payload in (None, bytes(4097)):
            with pytest.raises(ValueError):
                group.broadcast(payload)
        control = group.spec.split("|", 1)[1]
        for spec in ("", "dist:", "dist:mpi,1,0|" + control, "dist:gloo,port,0|" + control, "dist:gloo,1|" + control,
                     group.spec.split("|")[0]):
            with pytest.raises(ValueError):
                DistGroup.attach(spec, 1)
        for rank in (-1, 0, 2):
            with pytest.raises(ValueError):
                DistGroup.attach(group.spec, rank)
        for backend in ("shm", "mpi", "NCCL", ""):
            with pytest.raises(ValueError):
                DistGroup.create(2, 4096, backend)
    finally:
        group.close()
    assert leftovers(group.prefix) == []
    with DistGroup.create(1, 1024, "gloo") as alone:
        alone.barrier()
        t = torch.arange(15, dtype=torch.bfloat16)
        assert torch.equal(alone.all_reduce_(t), torch.arange(15, dtype=torch.bfloat16))
        assert alone.broadcast(b"plan") == b"plan"
        (part,) = alone.gather(t)
        assert torch.equal(part, t)
    assert leftovers(alone.prefix) == []
    with pytest.raises(RuntimeError, match="closed"):
        alone.all_reduce_(torch.zeros(4))


def test_mismatched_ranks_raise_the_same_value_error_and_stay_in_step():
    """Two ranks in one process (threads): tensors of different sizes or dtypes are a ValueError on both
    ranks, after which the group still works; a receiving rank may not send."""
    with ShmGroup.create(2, 4096, timeout_s=10.0) as group0, ShmGroup.attach(group0.spec, 1) as group1:
        with pytest.raises(ValueError, match="pass None"):
            group1.broadcast(b"plan")
        cases = [(torch.zeros(10), torch.zeros(12)), (torch.zeros(8), torch.zeros(8, dtype=torch.float16)),
                 (torch.zeros(3, 4), torch.zeros(13)), (torch.ones(6), torch.ones(6))]
        for t0, t1 in cases:
            outcome = {}

            def run(group, t, rank):
                try:
                    outcome[rank] = group.all_reduce_(t)
                except ValueError as e:
                    outcome[rank] = e

            other = threading.Thread(target=run, args=(group1, t1, 1))
            other.start()
            run(group0, t0, 0)
            other.join(10)
            if t0.shape == t1.shape and t0.dtype == t1.dtype:
                assert torch.equal(outcome[0], torch.full((6,), 2.0)) and torch.equal(outcome[1], outcome[0])
            else:
                assert all(isinstance(outcome[r], ValueError) and "same size and dtype" in str(outcome[r])
                           for r in (0, 1))
    assert leftovers(group0.prefix) == []


@pytest.mark.parametrize("backend, op", [("shm", "all_reduce"), ("shm", "barrier"), ("shm", "broadcast"),
                                         ("gloo", "all_reduce")])
def test_killed_rank_raises_rank_died_everywhere(backend, op, tmp_path):
    """World 3: rank 2 is SIGKILLed while rank 1 waits in ``op`` (and rank 0 too, but for broadcast, where
    rank 1 waits for rank 0, which carries on): RankDied on every rank within ~1-2 s, on_death once.
    (A DistGroup's barrier and broadcast are its control ShmGroup's; its all-reduce is gloo's.)"""
    deaths, died = [], threading.Event()

    def on_death(rank, code):
        deaths.append((rank, code))
        died.set()

    with ranks_of(3, f"wait_{op}", tmp_path, sleeper=2, on_death=on_death, backend=backend) as (group, ranks):
        killed_at = []
        killer = threading.Timer(0.3, lambda: (killed_at.append(time.monotonic()),
                                               os.kill(ranks.pids[2], signal.SIGKILL)))
        killer.start()
        if op == "broadcast":
            assert died.wait(5)
            with pytest.raises(RankDied, match="rank 2"):
                group.broadcast(b"plan")
        else:
            with pytest.raises(RankDied, match="rank 2"):
                cr.wait_in(group, op)
            assert time.monotonic() - killed_at[0] < 2.0
        killer.join()
        outcome = tmp_path / "rank1.json"
        wait_for(outcome.exists, 5, "rank 1 reports")
        result = json.loads(outcome.read_text())
        assert result["error"] == "RankDied" and "rank 2" in result["message"]
        assert result["seconds"] < 0.3 + 2.0
        assert died.wait(5)
        wait_for(lambda: ranks.procs[1].poll() is not None, 5, "rank 1 exits")
        time.sleep(0.1)                        # the watchdog would have reported rank 1 by now
    assert deaths == [(2, -signal.SIGKILL)]


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_stopped_rank_hits_the_deadline(backend, tmp_path):
    """A rank that stops answering without dying: rank 0's all-reduce raises RankDied after the group's
    timeout (gloo's own for a DistGroup, then up to DEAD_PEER_S looking for a dead peer)."""
    deaths = []
    with ranks_of(2, "wait_all_reduce", tmp_path, sleeper=1, timeout_s=1.0,
                  on_death=lambda *d: deaths.append(d), backend=backend) as (group, ranks):
        os.kill(ranks.pids[1], signal.SIGSTOP)
        start = time.monotonic()
        message = "rank 1 did not arrive within 1 s" if backend == "shm" else "gloo collective failed"
        with pytest.raises(RankDied, match=message):
            group.all_reduce_(torch.ones(100))
        assert 1.0 <= time.monotonic() - start < (2.5 if backend == "shm" else 3.5)
        with pytest.raises(RankDied, match="missed a deadline"):
            group.barrier()                    # the group stays failed
        start = time.monotonic()
        ranks.close()                          # SIGTERM reaches the stopped rank (SIGCONT), no SIGKILL wait
        assert time.monotonic() - start < 1.5
    assert deaths == []


def test_ranks_leave_when_rank0_is_killed(tmp_path):
    """The server (rank 0) SIGKILLed while its ranks wait for the next plan: they raise RankDied and exit
    within seconds; its names are stale and cleanup_stale() removes them."""
    host = subprocess.Popen([sys.executable, "-m", "collective_rank", "host", "2", str(tmp_path)],
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)])),
                            stdin=subprocess.DEVNULL)
    pids = []
    try:
        info_path = tmp_path / "host.json"
        wait_for(lambda: info_path.exists() or host.poll() is not None, START_S, "the host starts its ranks")
        info = json.loads(info_path.read_text())
        pids = list(info["ranks"].values())
        host.kill()
        host.wait()
        outcome = tmp_path / "rank1.json"
        wait_for(outcome.exists, 5, "rank 1 reports")
        result = json.loads(outcome.read_text())
        assert result["error"] == "RankDied" and "rank 0" in result["message"]
        wait_for(lambda: not any(pid_alive(pid) for pid in pids), 5, "the ranks exit")
        assert leftovers(info["prefix"])                     # SIGKILL: no atexit
        cleanup_stale()
        assert leftovers(info["prefix"]) == []
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_cores_for_ranks(tmp_path):
    allowed = set(range(8))
    assert cores_for_ranks(2, "0-3;4-7", allowed=allowed) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cores_for_ranks(2, "0,2;1,3", allowed=allowed) == [[0, 2], [1, 3]]
    assert cores_for_ranks(3, "0;1;7", allowed=allowed) == [[0], [1], [7]]
    for spec in ("0-3", "0-3;4-7;", "0-3;3-7", "0-3;8", "a;1", "3-1;4", "0,0;1", "0-3;4-7;5"):
        with pytest.raises(ValueError):
            cores_for_ranks(2, spec, allowed=allowed)
    nodes = tmp_path / "node"
    for node, cpus in ((0, "0-3"), (1, "4-7"), (2, "8-11"), (3, "12-15")):
        (nodes / f"node{node}").mkdir(parents=True)
        (nodes / f"node{node}" / "cpulist").write_text(cpus + "\n")
    every = set(range(16))
    assert cores_for_ranks(4, None, node_dir=nodes, allowed=every) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                                                       [12, 13, 14, 15]]
    assert cores_for_ranks(2, None, node_dir=nodes, allowed=every) == [list(range(8)), list(range(8, 16))]
    # nodes without allowed CPUs do not count; too few nodes: the allowed CPUs split evenly
    assert cores_for_ranks(2, None, node_dir=nodes, allowed={1, 2, 13}) == [[1, 2], [13]]
    assert cores_for_ranks(3, None, node_dir=nodes, allowed={0, 1, 2, 3, 4, 5}) == [[0, 1], [2, 3], [4, 5]]
    assert cores_for_ranks(2, None, node_dir=tmp_path / "none", allowed={0, 1, 2}) == [[0, 1], [2]]
    for world, cpus in ((3, {0, 1}), (2, {5})):
        with pytest.raises(ValueError, match="at least"):
            cores_for_ranks(world, None, node_dir=nodes, allowed=cpus)
    assert parse_cpulist("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8]
    (mine,) = cores_for_ranks(1, None)            # this machine's own nodes or CPUs
    assert mine and set(mine) <= os.sched_getaffinity(0)
