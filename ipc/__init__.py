"""CPU LoRA workers over POSIX shared memory (CaraServe §4): the host tier's shared arena, the
layer-wise job protocol, the worker process and the profile that decides when to use them; and the
tensor-parallel ranks' collectives over the same kind of shared memory (S-LoRA §6 on CPU sockets).

Imports nothing from asyncserve, so a worker (``python -m ipc.worker``) starts with torch and numpy
only. The server process owns every shared object; workers only attach.

Names and hygiene (ipc/names.py)
    Segments and semaphores are ``/asyncserve-<server pid>-<token>-<what>`` (random token per owner).
    ``close()`` of an owner unlinks its names; an atexit hook unlinks what is left at a normal exit;
    ``cleanup_stale()`` (call it at server start) removes those of dead pids, e.g. after SIGKILL.

Host tier (ipc/arena.py)
    arena = HostArena(capacity_bytes, slots=4096)
    handle = arena.store(ranks, scaling, a_rows, b_rows)   # HostAdapter's fields; ArenaFull if no room
    # or in two halves: handle = arena.allocate(num_layers, ranks, shapes, dtype) where the
    # bookkeeping lives (ArenaFull), then arena.write(handle, ranks, scaling, a_rows, b_rows) in another thread
    view = arena.view(handle)       # AdapterView: zero-copy a_rows [r, in] / b_rows [r, out] (B^T), so the
                                    # host copy the pager pages to the device IS the shared one
    arena.release(handle)           # LRU eviction; handle.nbytes, arena.fits(n), block_bytes(...) to plan
    arena.close()
    reader = ArenaReader(arena.name, slots)  # another process's (a tensor-parallel rank's): view(handle), close()

Layer-wise jobs (ipc/pool.py)
    pool = WorkerPool(arena, n, max_tokens=..., max_in=..., max_out=..., dtype=model dtype, cpus=None)
                                    # cpus: pin the workers there (a tensor-parallel rank's cores)
    pool.wait_ready(timeout)        # at start; afterwards workers join as they come up
    group = ProjectionGroup(in_features, out_features, ((proj_index, first_column), ...), rank, world, row_parallel)
                                    # one per lora.batch GROUPS entry (stepper/assist.py projection_groups);
                                    # world > 1: rank's shard, A sliced by inputs (row_parallel) or B^T by
                                    # outputs (arena.shard_tensors), read in place from the arena
    # per layer and group of a step with cold adapters: x_cold = x[cold rows], tasks partition them
    pool.submit(layer, group, x_cold, [(handle, row0, row1), ...], workers=k)
    y = base(x)                     # the device computes the base projection meanwhile
    delta = pool.collect(timeout)   # [cold tokens, out_features] = x·A·B·scaling per task's adapter,
                                    # projections the adapter does not target are zero; a view valid
                                    # until the next submit
    y[cold rows] += delta           # (to the device); those segments carry seg_adapter = -1
    # CpuAssistError (WorkerDied, WorkerTimeout, JobFailed, NoWorkers): compute those deltas on the
    # device path instead; a dead or late worker is already being replaced (pool.restarts counts).
    pool.live                       # ready workers, the asyncserve_cpu_workers gauge: a watchdog thread
                                    # reaps a dead worker and replaces it (backing off if it keeps dying)
                                    # whether jobs come or not
    pool.close()

Profile and decision (ipc/profile.py)
    path = profile_path(cache_dir)                     # cache_dir/<cpu model>.json
    profile = WorkerProfile.load(path) if path.exists() else fit(measure(pool, in_features=.., out_features=..))
    m = macs_per_token(ranks, shapes)       # Σ rank·(in+out) of a group's projections
    should_assist(profile, tokens, [(m, device_seconds) per layer job], load_seconds, pool.live)
        -> AssistDecision(assist, workers, stall_s)      # the --cpu-assist auto rule
    choose_workers(profile, tokens, m, available, budget_s)
    ``python -m ipc.profile --out DIR`` records DIR/<cpu model>.json with its command.

Tensor-parallel collectives (ipc/collective.py, ipc/ranks.py)
    group = ShmGroup.create(world, max_bytes, timeout_s=30.0)     # rank 0 (the server's stepper)
    cores = cores_for_ranks(world, tp_cores)   # "0-3;4-7", else whole NUMA nodes, else the CPUs split evenly
    ranks = RankProcesses(group, "asyncserve.stepper.tp_rank", [...], cores=cores, on_death=fn)
                                    # ranks 1.. run `python -m <module> <group.spec> <rank> ...`, pinned,
                                    # OMP/MKL threads = their CPUs; on_death(rank, returncode) once, from
                                    # the watchdog thread, for the first rank that exits for any reason
    ranks.wait_ready(timeout_s)     # each rank: group = ShmGroup.attach(spec, rank); load; group.barrier()
    # per step, every rank in the same order:
    plan = group.broadcast(payload if rank 0 else None)   # bytes, <= max_bytes
    group.all_reduce_(t)            # in place, float32/bf16/fp16 CPU, contiguous, <= max_bytes: summed in
                                    # rank order in float32, rounded once: bit-identical on every rank
    parts = group.gather(t)         # rank 0: every rank's tensor; the others: None
    group.barrier()
    ranks.close()                   # SIGTERM (then SIGKILL), reap, close the group: /dev/shm clean
    # RankDied: a rank died (pid checks every WAIT_SLICE_S), rank 0 waited past timeout_s, or the group was
    # marked failed by another rank; GroupClosed (a RankDied) on ranks >= 1 when rank 0 closed the group.
    # Ranks >= 1 wait for rank 0 without a deadline (an idle server sends no plan); they leave when it dies.
    # Small tensors: every rank sums all slots (one phase); from split_bytes up, reduce-scatter then
    # all-gather (two phases). A wait spins spin_us on the peer's counter, then sleeps on a semaphore.
    ``python scripts/bench_allreduce.py`` measures the sync and all-reduce latency on this host.

Tensor-parallel collectives over torch.distributed (ipc/dist.py, imported on its own: torch.distributed)
    group = create_group(backend, world, max_bytes, timeout_s, first_device)   # shm: ShmGroup; gloo | nccl:
                                    # DistGroup, the same interface; group.device: where its tensors live
                                    # (cpu; cuda:first_device+rank with nccl)
    group = attach_group(spec, rank)    # a rank >= 1, either kind by its spec
    # DistGroup: all_reduce_ and gather over the backend (NCCL on the GPU, queued: the host goes on);
    # broadcast, barrier and the supervision over a control ShmGroup (idle ranks wait for hours without
    # a backend timeout). The backend connects in the first barrier (the ranks' ready), rendezvous on a
    # TCPStore at 127.0.0.1:<a port the OS picked>. A backend error raises RankDied naming the dead peer;
    # fail() (the watchdog's) aborts an NCCL communicator so that waiting kernels end.

Workers compute in float32 (bf16 storage widened per job) and round the delta once; one torch
thread each. On CUDA, ``submit``'s copy of x into shared memory is a synchronous device-to-host copy
(CaraServe's fused async copy-and-signal is not done here).
"""
from ipc.arena import AdapterHandle, AdapterView, ArenaFull, ArenaReader, HostArena, block_bytes
from ipc.collective import GroupClosed, RankDied, ShmGroup, cores_for_ranks
from ipc.names import cleanup_stale, leftovers
from ipc.pool import (CpuAssistError, JobFailed, NoWorkers, ProjectionGroup, WorkerDied, WorkerPool,
                      WorkerTimeout)
from ipc.ranks import RankProcesses

_PROFILE = {"AssistDecision", "WorkerProfile", "choose_workers", "fit", "macs_per_token", "measure", "profile_path",
            "should_assist"}


def __getattr__(name: str):
    # imported on first use, so `python -m ipc.profile` does not find itself already imported
    if name in _PROFILE:
        import ipc.profile
        return getattr(ipc.profile, name)
    raise AttributeError(f"module 'ipc' has no attribute {name!r}")


__all__ = [
    "AdapterHandle", "AdapterView", "ArenaFull", "ArenaReader", "HostArena", "block_bytes", "cleanup_stale",
    "leftovers",
    "GroupClosed", "RankDied", "RankProcesses", "ShmGroup", "cores_for_ranks",
    "CpuAssistError", "JobFailed", "NoWorkers", "ProjectionGroup", "WorkerDied", "WorkerPool", "WorkerTimeout",
    *sorted(_PROFILE),
]
