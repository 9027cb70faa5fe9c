"""ipc/: the shared arena, the CPU LoRA worker pool against a float64 reference, worker faults,
/dev/shm hygiene, the profile and scripts/make_adapters.py. Every process started here is killed or
stopped here, by pid."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ipc
from asyncserve.lora.backend import group_layout
from asyncserve.model.config import GROUPS, PROJ_INDEX, PROJECTIONS
from asyncserve.model.config import ModelConfig
from asyncserve.model.shard import Shard, shard_config
from asyncserve.pager.adapters import load_peft_adapter
from asyncserve.stepper.assist import projection_groups
from ipc import (ArenaFull, HostArena, JobFailed, ProjectionGroup, WorkerDied, WorkerPool, WorkerTimeout,
                 cleanup_stale, leftovers)
from ipc.arena import Allocator
from ipc.layout import DIR_ENTRY, align
from ipc.names import pid_alive

REPO = Path(__file__).resolve().parent.parent
CONFIG = ModelConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16)
LAYOUT = group_layout(CONFIG)
GROUP = projection_groups(CONFIG, Shard(0, 1))
MAX_TOKENS = 96
START_S = 120        # worker start (imports torch) on a loaded 2-core machine

pytestmark = pytest.mark.timeout(180)


def random_adapter(ranks: dict[str, int], dtype: torch.dtype, seed: int):
    """HostAdapter's fields: ranks per projection, scaling [L, P], A [r, in] and B^T [r, out]."""
    g = torch.Generator().manual_seed(seed)
    shapes = CONFIG.projection_shapes()
    rank_list = [ranks.get(p, 0) for p in PROJECTIONS]
    scaling = torch.rand(CONFIG.num_layers, len(PROJECTIONS), generator=g) + 0.5
    scaling *= torch.tensor(rank_list).clamp(max=1)            # 0 where not targeted, as in HostAdapter
    a_rows, b_rows = {}, {}
    for layer in range(CONFIG.num_layers):
        for p, proj in enumerate(PROJECTIONS):
            if rank_list[p]:
                fan_in, fan_out = shapes[proj]
                a_rows[(layer, p)] = torch.randn(rank_list[p], fan_in, generator=g).to(dtype)
                b_rows[(layer, p)] = torch.randn(rank_list[p], fan_out, generator=g).to(dtype)
    return rank_list, scaling, a_rows, b_rows


def reference(adapters: dict, layer: int, group: str, x: torch.Tensor, tasks) -> torch.Tensor:
    """float64 x·A·B·scaling per task's rows, columns laid out as the group's fused output."""
    ref = torch.zeros(x.shape[0], GROUP[group].out_features, dtype=torch.float64)
    for handle, r0, r1 in tasks:
        ranks, scaling, a_rows, b_rows = adapters[handle]
        for proj, _, fan_out, col in LAYOUT[group]:
            p = PROJ_INDEX[proj]
            if ranks[p]:
                a, bt = a_rows[(layer, p)].double(), b_rows[(layer, p)].double()
                ref[r0:r1, col:col + fan_out] = x[r0:r1].double() @ a.t() @ bt * float(scaling[layer, p])
    return ref


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def setup(request):
    dtype = request.param
    arena = HostArena(8 << 20, slots=64)
    pool = WorkerPool(arena, 3, max_tokens=MAX_TOKENS, max_in=CONFIG.intermediate_size,
                      max_out=max(g.out_features for g in GROUP.values()), dtype=dtype)
    try:
        # mixed ranks and target sets, a projection group partly targeted
        specs = [{"q_proj": 1, "v_proj": 1}, {"q_proj": 7, "k_proj": 7, "v_proj": 7, "o_proj": 7},
                 {p: 16 for p in PROJECTIONS}, {"k_proj": 64, "up_proj": 64, "down_proj": 3}]
        adapters = {}
        for i, spec in enumerate(specs):
            fields = random_adapter(spec, dtype, seed=i)
            adapters[arena.store(*fields)] = fields
        assert pool.wait_ready(START_S) == 3
        yield dtype, arena, pool, adapters
    finally:
        pool.close()
        arena.close()


def check(dtype, got: torch.Tensor, ref: torch.Tensor) -> None:
    # fp32: float32 arithmetic; bf16: the delta is rounded once to bf16 (8 bits of mantissa)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


def run_job(pool, adapters, layer, group, tokens, workers, seed=0, timeout=30.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, GROUP[group].in_features, generator=g).to(pool.dtype)
    handles = list(adapters)
    # segments of several adapters, one adapter twice, odd lengths
    cuts = sorted({0, tokens, *(int(c) for c in torch.randint(1, max(2, tokens), (4,), generator=g))})
    tasks = [(handles[i % len(handles)], r0, r1) for i, (r0, r1) in enumerate(zip(cuts, cuts[1:])) if r1 > r0]
    used = pool.submit(layer, GROUP[group], x, tasks, workers=workers)
    assert used == min(workers, tokens)
    return pool.collect(timeout), reference(adapters, layer, group, x, tasks)


@pytest.mark.parametrize("tokens", [1, 13, 95])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_deltas_match_float64(setup, tokens, workers):
    dtype, _, pool, adapters = setup
    for layer in range(CONFIG.num_layers):
        for group in GROUPS:
            got, ref = run_job(pool, adapters, layer, group, tokens, workers, seed=tokens * 7 + layer)
            check(dtype, got, ref)


def test_worker_killed_mid_job(setup):
    dtype, _, pool, adapters = setup
    restarts = pool.restarts
    victim = pool.workers[0].proc
    os.kill(victim.pid, signal.SIGSTOP)          # it cannot finish: the job is surely in flight when it dies
    x = torch.randn(31, CONFIG.hidden_size).to(dtype)
    pool.submit(0, GROUP["qkv"], x, [(next(iter(adapters)), 0, 31)], workers=3)
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDied):
        pool.collect(timeout=20.0)
    assert time.monotonic() - t0 < 20.0
    assert pool.restarts == restarts + 1 and victim.poll() == -signal.SIGKILL
    assert pool.wait_ready(START_S) == 3
    got, ref = run_job(pool, adapters, 1, "gate_up", 40, workers=3)
    check(dtype, got, ref)


def test_worker_timeout_replaces_worker(setup):
    dtype, _, pool, adapters = setup
    restarts = pool.restarts
    victim = pool.workers[1].proc
    os.kill(victim.pid, signal.SIGSTOP)
    pool.submit(1, GROUP["down"], torch.randn(9, CONFIG.intermediate_size).to(dtype),
                [(list(adapters)[3], 0, 9)], workers=3)
    with pytest.raises(WorkerTimeout):
        pool.collect(timeout=0.5)
    assert pool.restarts == restarts + 1 and victim.poll() == -signal.SIGKILL   # the pool killed it
    assert pool.wait_ready(START_S) == 3
    got, ref = run_job(pool, adapters, 1, "down", 9, workers=3)
    check(dtype, got, ref)


def test_released_adapter_fails_the_job_not_the_worker(setup):
    dtype, arena, pool, adapters = setup
    handle = arena.store(*random_adapter({"o_proj": 5}, dtype, seed=9))
    arena.release(handle)
    pool.submit(0, GROUP["o"], torch.randn(5, CONFIG.q_size).to(dtype), [(handle, 0, 5)], workers=1)
    with pytest.raises(JobFailed, match="released"):
        pool.collect(timeout=20.0)
    got, ref = run_job(pool, adapters, 0, "o", 5, workers=1)
    check(dtype, got, ref)


def test_shard_jobs_are_each_ranks_slice_of_the_whole(setup):
    """Tensor parallelism (S-LoRA §6), 2 ranks: a column-parallel group's job gives the rank's output
    columns of each projection's whole delta from the whole x; a row-parallel group's jobs, each from
    the rank's slice of x's inputs, sum to the whole delta. A shard that cuts a projection unevenly
    fails the job, not the worker."""
    dtype, _, pool, adapters = setup
    world, tokens = 2, 29
    layout = group_layout(shard_config(CONFIG, world))
    for layer in range(CONFIG.num_layers):
        for group in GROUPS:
            x = torch.randn(tokens, GROUP[group].in_features, generator=torch.Generator().manual_seed(layer)).to(dtype)
            tasks = [(h, r0, r1) for h, (r0, r1) in zip(adapters, ((0, 3), (3, 4), (4, 20), (20, tokens)))]
            whole = reference(adapters, layer, group, x, tasks)
            row_parallel = group in ("o", "down")
            summed = torch.zeros_like(whole)
            for rank in range(world):
                spec = projection_groups(shard_config(CONFIG, world), Shard(rank, world))[group]
                assert (spec.rank, spec.world, spec.row_parallel) == (rank, world, row_parallel)
                width = spec.in_features
                x_rank = x[:, rank * width:(rank + 1) * width] if row_parallel else x
                pool.submit(layer, spec, x_rank.contiguous(), tasks, workers=2)
                got = pool.collect(30.0)
                if row_parallel:
                    summed += got.double()
                    continue
                for (_, _, fan_out, col), (_, _, part, shard_col) in zip(LAYOUT[group], layout[group]):
                    assert part * world == fan_out
                    check(dtype, got[:, shard_col:shard_col + part], whole[:, col + rank * part:col + (rank + 1) * part])
            if row_parallel:
                check(dtype, summed, whole)
    uneven = ProjectionGroup(CONFIG.hidden_size, 22, ((PROJ_INDEX["q_proj"], 0),), 0, 3)      # 64 outputs over 3
    pool.submit(0, uneven, torch.randn(4, CONFIG.hidden_size).to(dtype), [(list(adapters)[2], 0, 4)], workers=1)
    with pytest.raises(JobFailed, match="do not split over 3 ranks"):
        pool.collect(timeout=20.0)
    got, ref = run_job(pool, adapters, 1, "qkv", 7, workers=3)
    check(dtype, got, ref)


def test_arena_views_are_the_stored_tensors(setup):
    dtype, arena, _, adapters = setup
    for handle, (ranks, scaling, a_rows, b_rows) in adapters.items():
        view = arena.view(handle)
        assert view.ranks == ranks and torch.equal(view.scaling, scaling.float())
        assert view.a_rows.keys() == a_rows.keys() and view.b_rows.keys() == b_rows.keys()
        for key in a_rows:
            assert view.a_rows[key].dtype == dtype
            assert torch.equal(view.a_rows[key], a_rows[key]) and torch.equal(view.b_rows[key], b_rows[key])


def test_arena_rows_lie_end_to_end_unless_padded():
    """rows(): the block's rows as one flat view in write order (what the pager copies into pages in
    one piece), and None where alignment left gaps between them."""
    ranks, scaling, a_rows, b_rows = random_adapter({"q_proj": 2, "v_proj": 1, "down_proj": 3}, torch.bfloat16, seed=3)
    with HostArena(1 << 20, slots=4) as arena:
        handle = arena.store(ranks, scaling, a_rows, b_rows)
        want = torch.cat([t.reshape(-1) for key in a_rows for t in (a_rows[key], b_rows[key])])
        got = arena.rows(handle)
        assert got is not None and torch.equal(got, want)
        # 3 and 5 float32 elements: 12 and 20 bytes, each padded to 64
        odd = arena.store([1], torch.ones(1, 1), {(0, 0): torch.ones(1, 3)}, {(0, 0): torch.ones(1, 5)})
        assert arena.rows(odd) is None
        arena.release(handle)
        with pytest.raises(KeyError):
            arena.rows(handle)


def test_allocator_allocate_free_reuse():
    alloc = Allocator(100, 100 + 64 * 10)                  # start rounds up to 128: 9 units of 64 B
    a, b, c = alloc.allocate(64), alloc.allocate(100), alloc.allocate(64 * 3)
    assert (a, b, c) == (128, 192, 320) and alloc.free_bytes == 64 * 3
    assert alloc.allocate(64 * 4) is None
    alloc.free(b)                                           # a hole of 128 B between a and c
    assert alloc.allocate(64) == 192 and alloc.allocate(64) == 256
    alloc.free(192)
    alloc.free(256)
    alloc.free(a)
    alloc.free(c)                                           # everything merges back into one run
    assert alloc.free_runs == [(128, 64 * 9)] and not alloc.used


def test_arena_full_and_reuse_after_release():
    fields = random_adapter({p: 8 for p in PROJECTIONS}, torch.float32, seed=1)
    nbytes = ipc.block_bytes(CONFIG.num_layers, len(PROJECTIONS), fields[0],
                             list(CONFIG.projection_shapes().values()), torch.float32)
    with HostArena(align(8 * DIR_ENTRY.itemsize) + 3 * nbytes + 64, slots=8) as arena:   # three adapters fit
        handles = [arena.store(*fields) for _ in range(3)]
        assert all(h.nbytes == nbytes for h in handles) and not arena.fits(nbytes)
        with pytest.raises(ArenaFull):
            arena.store(*fields)
        offset_of_released = int(arena.directory[handles[1].slot]["offset"])
        arena.release(handles[1])                           # the LRU tier evicts one
        again = arena.store(*random_adapter({"q_proj": 4}, torch.float32, seed=2))
        # first fit: the freed hole, and the freed slot with a new generation
        assert again.slot == handles[1].slot and again.generation == handles[1].generation + 1
        assert arena.directory[again.slot]["offset"] == offset_of_released
        with pytest.raises(KeyError):
            arena.view(handles[1])
        assert torch.equal(arena.view(handles[0]).a_rows[(1, 6)], fields[2][(1, 6)])


def test_host_adapter_from_make_adapters(tmp_path):
    """scripts/make_adapters.py's folders load as HostAdapters, which the arena keeps and the workers
    apply exactly as the PEFT tensors say (alpha / r, B [out, r])."""
    spec = importlib.util.spec_from_file_location("make_adapters", REPO / "scripts/make_adapters.py")
    make_adapters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_adapters)
    make_adapters.main(["3", str(tmp_path), "--model", "tiny", "--ranks", "2", "5",
                        "--targets", "all", "q_proj,v_proj"])
    folders = sorted(tmp_path.iterdir())
    assert [f.name for f in folders] == ["a0000", "a0001", "a0002"]
    with HostArena(4 << 20, slots=8) as arena, WorkerPool(arena, 2, max_tokens=16, max_in=128, max_out=256,
                                                          dtype=torch.float32) as pool:
        host = [load_peft_adapter(f.name, f, CONFIG, torch.float32) for f in folders]
        handles = [arena.store(h.ranks, h.scaling, h.a_rows, h.b_rows) for h in host]
        assert pool.wait_ready(START_S) == 2
        x = torch.randn(11, CONFIG.hidden_size)
        tasks = [(handles[0], 0, 4), (handles[1], 4, 9), (handles[2], 9, 11)]
        pool.submit(1, GROUP["qkv"], x, tasks)
        got = pool.collect(30.0).double()
        ref = torch.zeros_like(got)
        for (_, r0, r1), folder in zip(tasks, folders):
            tensors = load_file(folder / "adapter_model.safetensors")
            config = json.loads((folder / "adapter_config.json").read_text())
            for proj, _, fan_out, col in LAYOUT["qkv"]:
                key = f"base_model.model.model.layers.1.self_attn.{proj}"
                if f"{key}.lora_A.weight" in tensors:
                    a, b = tensors[f"{key}.lora_A.weight"].double(), tensors[f"{key}.lora_B.weight"].double()
                    scaling = config["lora_alpha"] / config["r"]
                    ref[r0:r1, col:col + fan_out] = x[r0:r1].double() @ a.t() @ b.t() * scaling
        assert ref.abs().max() > 0
        check(torch.float32, got, ref)


def test_dev_shm_clean_after_close():
    arena = HostArena(1 << 20, slots=4)
    pool = WorkerPool(arena, 1, max_tokens=8, max_in=64, max_out=64, dtype=torch.float32)
    assert leftovers(arena.prefix) and leftovers(pool.prefix)
    assert pool.wait_ready(START_S) == 1
    worker = pool.workers[0].proc
    pool.close()
    arena.close()
    assert worker.poll() == 0                               # stopped by its stop job
    assert leftovers(arena.prefix) == [] and leftovers(pool.prefix) == []


SERVER = textwrap.dedent("""
    import sys, time, torch
    from ipc import HostArena, WorkerPool
    arena = HostArena(1 << 20, slots=4)
    pool = WorkerPool(arena, 1, max_tokens=8, max_in=64, max_out=64, dtype=torch.float32)
    assert pool.wait_ready(120) == 1
    print(pool.workers[0].proc.pid, flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)                 # no close(): the atexit hook unlinks, the worker notices
    time.sleep(600)
""")


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_server_death_leaves_nothing_behind(how):
    """A server exiting without close() unlinks its names at exit; one killed with SIGKILL leaves them
    for cleanup_stale(). Either way its worker exits by itself."""
    mine = HostArena(1 << 16, slots=1)               # a live server's names, which cleanup must keep
    server = subprocess.Popen([sys.executable, "-c", SERVER, how], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        worker_pid = int(server.stdout.readline())
        prefix = f"/asyncserve-{server.pid}-"
        if how == "sigkill":
            assert len(leftovers(prefix)) == 6             # arena, ctl, x, delta, 2 semaphores
            server.kill()
        server.wait(timeout=60)
        deadline = time.monotonic() + 10
        while pid_alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(worker_pid)
        if how == "sigkill":
            removed = cleanup_stale()
            assert len([r for r in removed if f"asyncserve-{server.pid}-" in r]) == 6
        assert leftovers(prefix) == []
        assert leftovers(mine.prefix)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        mine.close()


def test_profile_fit_decision_and_cache(tmp_path):
    truth = ipc.WorkerProfile(50e-6, 2e-10, 10e-6, "cpu")
    samples = [{"tokens": t, "rank": r, "workers": k, "macs_per_token": r * 3000,
                "seconds": truth.predict(t, r * 3000, k)} for t in (16, 64, 256) for r in (8, 64) for k in (1, 2, 4)]
    fitted = ipc.fit(samples, cpu="cpu", command="test")
    for attr in ("overhead_s", "per_mac_s", "per_worker_s"):
        assert getattr(fitted, attr) == pytest.approx(getattr(truth, attr), rel=1e-6)

    m = 64 * 3000
    # a budget of 1 ms per job: the fewest workers whose prediction fits it
    k = ipc.choose_workers(fitted, 256, m, available=16, budget_s=1e-3)
    assert fitted.predict(256, m, k) <= 1e-3 < fitted.predict(256, m, k - 1)
    jobs = [(m, 0.2e-3)] * 8
    slow_load = ipc.should_assist(fitted, 256, jobs, load_seconds=1.0, available=4)
    assert slow_load.assist and slow_load.workers == 4
    assert slow_load.stall_s == pytest.approx(8 * (fitted.predict(256, m, 4) - 0.2e-3))
    assert not ipc.should_assist(fitted, 256, jobs, load_seconds=slow_load.stall_s / 2, available=4).assist
    assert not ipc.should_assist(fitted, 256, jobs, load_seconds=1.0, available=0).assist

    path = ipc.profile_path(tmp_path, "Intel(R) Xeon(R) Processor")
    assert path.name == "intel-r-xeon-r-processor.json"
    fitted.save(path)
    assert ipc.WorkerProfile.load(path) == fitted


def test_profile_measures_the_pool(setup):
    _, arena, pool, _ = setup
    free = arena.free_bytes
    samples = ipc.measure(pool, in_features=64, out_features=32, ranks=(4, 16), token_counts=(8, 33), repeats=1)
    assert len(samples) == 2 * 2 * 3 and all(s["seconds"] > 0 for s in samples)
    assert {s["workers"] for s in samples} == {1, 2, 3}
    assert arena.free_bytes == free                   # its probe adapters were released
    profile = ipc.fit(samples)
    assert profile.predict(33, 16 * 96, 2) > 0


def test_repeated_deaths_back_off_exponentially_up_to_a_cap():
    from ipc.pool import BACKOFF_MAX_S, BACKOFF_S, _backoff

    delays = [_backoff(n) for n in range(1, 12)]
    assert delays[:4] == [0.0, BACKOFF_S, 2 * BACKOFF_S, 4 * BACKOFF_S]      # the first death: at once
    assert delays[-1] == BACKOFF_MAX_S and delays == sorted(delays)
