"""CPU-assisted LoRA (CaraServe §4): the CPU workers (ipc/) compute the LoRA of sequences whose adapter
is not on the device, from its host-tier copy, layer by layer beside the device's base projections.

    assist = CpuAssist(pager.arena, model_config, workers, dtype, device, max_tokens, profile_dir, weights)
    workers = assist.workers_for(tasks, rows)   # how many workers a job of this step takes (the profile's)
    assist.begin_step(tasks, rows, workers)     # per step: (host block, row0, row1, ranks) over the cold rows
    if assist.active:                           # the step has cold rows
        forward(..., lora=AssistedLora(assist, backend))

Per (layer, projection group) AssistedLora submits x of the cold rows to shared memory, lets the
backend compute the base GEMM (and the device LoRA of warm rows) meanwhile, then collects the
workers' deltas and adds them to the cold rows (CaraServe's layer-wise sync). If the workers fail
the job (a worker killed, late, or erring: CpuAssistError), those deltas are computed here in torch
from the same host copy, in float32 like the workers, so the tokens stay the same; the pool has
already replaced the worker.

Whether assisting a request pays (``--cpu-assist auto``) is the profile's call: the workers' job
time (ipc/profile.py, measured at start or read from the cache per CPU, model and dtype) beyond the
device's own time for the same projections, summed over the prefill's jobs, against the time the
adapter's copy to the device would add. On a CPU device whose threads leave the workers no cores of
their own, nothing overlaps and the whole job time counts.

Under tensor parallelism every rank has a pool of workers of its own, on its own cores (LayerAssist on
ranks 1..N-1, CpuAssist on rank 0), and each computes its shard of every cold row's LoRA: x · A · B
[its output columns] for q/k/v and gate/up, x_r · A[its input rows] · B for o and down, added to the
partial output before the all-reduce. Rank 0 alone decides (which rows are cold, how many workers a
job takes: the step message carries both), so the ranks never disagree; no rank waits on another's
workers, and the collectives per layer stay the base model's two (docs/tensor-parallel.md).
"""
from __future__ import annotations

import logging
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from asyncserve.cpus import usable_cpus
from asyncserve.lora.backend import LoraBackend, group_layout
from asyncserve.model.config import GROUPS, PROJ_INDEX, ModelConfig
from asyncserve.model.linear import Linear
from asyncserve.model.shard import ROW_PARALLEL, Shard
from ipc import AdapterHandle, CpuAssistError, HostArena, ProjectionGroup, WorkerPool
from ipc.arena import ArenaReader, shard_tensors
from ipc.profile import (WorkerProfile, choose_workers, cpu_model, fit, macs_per_token, measure, profile_path,
                         should_assist)

log = logging.getLogger("asyncserve.assist")

JOB_TIMEOUT_S = 10.0                 # a job later than this is the workers' failure: recomputed here
READY_TIMEOUT_S = 60.0               # workers starting (a python with torch each)
PROFILE_RANKS = (8, 64)
PROFILE_TOKENS = (16, 128)
COPY_PROBE_BYTES = 8 << 20


def projection_groups(config: ModelConfig, shard: Shard) -> dict[str, ProjectionGroup]:
    """Per group, the job the workers compute: config's projection shapes (under tensor parallelism the
    rank's shard, whose o and down are row-parallel)."""
    return {g: ProjectionGroup(rows[0][1], sum(r[2] for r in rows), tuple((PROJ_INDEX[p], col) for p, _, _, col in rows),
                               shard.rank, shard.world, all(p in ROW_PARALLEL for p in GROUPS[g]))
            for g, rows in group_layout(config).items()}


def targeted_groups(tasks: list[tuple[AdapterHandle, int, int, list[int]]]) -> set[str]:
    """The groups with a projection some task's adapter targets."""
    return {g for g, projs in GROUPS.items() if any(ranks[PROJ_INDEX[p]] for *_, ranks in tasks for p in projs)}


class LayerAssist:
    """A rank's workers and a step's cold rows: per (layer, group), the workers' job submitted before the
    device's projection and collected after it, or recomputed in torch where they fail. config is the
    rank's shard under tensor parallelism (``shard``); cpus: the cores the workers share with it."""

    def __init__(self, arena: ArenaReader, config: ModelConfig, shard: Shard, num_workers: int, dtype: torch.dtype,
                 device: torch.device, max_tokens: int, cpus: list[int] | None = None):
        self.config, self.device, self.dtype = config, device, dtype
        self.groups = projection_groups(config, shard)
        self.pool = WorkerPool(arena, num_workers, max_tokens=max_tokens,
                               max_in=max(g.in_features for g in self.groups.values()),
                               max_out=max(g.out_features for g in self.groups.values()), dtype=dtype, cpus=cpus)
        self.tokens_total = 0            # tokens whose LoRA the workers computed
        self.fallbacks = 0               # layer jobs recomputed here after a worker failure
        self._tasks: list[tuple[AdapterHandle, int, int]] = []
        self._rows: torch.Tensor | None = None
        self._targets: set[str] = set()
        self._workers = 0
        self._views: dict[AdapterHandle, object] = {}
        try:
            if self.pool.wait_ready(READY_TIMEOUT_S) < 1:
                raise RuntimeError("no CPU LoRA worker started")
        except BaseException:
            self.pool.close()
            raise

    # ---- steps (torch thread) ------------------------------------------------------------------

    def begin_step(self, tasks: list[tuple[AdapterHandle, int, int, list[int]]], rows: list[int], workers: int) -> None:
        """tasks: per cold run, (host block, first, end row among the cold rows, its ranks);
        rows: the step's token rows that are cold, in order; workers: how many a job takes."""
        self._tasks = [(h, r0, r1) for h, r0, r1, _ in tasks]
        self._views = {}
        if not tasks:
            self._rows = None
            return
        self._rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self._targets = targeted_groups(tasks)
        self._workers = workers
        self.tokens_total += len(rows)

    @property
    def active(self) -> bool:
        return self._rows is not None

    def project(self, layer: int, group: str, x: torch.Tensor, device_project) -> torch.Tensor:
        """y = device_project(x) plus the cold rows' LoRA of ``group``: submitted before the device's
        projection, collected after it. x: [T, in]."""
        if group not in self._targets:
            return device_project(x)
        x_cold = x.index_select(0, self._rows)                        # [cold, in]
        spec = self.groups[group]
        try:
            self.pool.submit(layer, spec, x_cold, self._tasks, workers=self._workers)
            submitted = None
        except (CpuAssistError, ValueError) as e:      # no worker ready; more tasks than a job takes
            submitted = e
        y = device_project(x)                                         # [T, out]
        try:
            if submitted is not None:
                raise submitted
            delta = self.pool.collect(JOB_TIMEOUT_S)                   # [cold, out]
        except (CpuAssistError, ValueError) as e:
            log.warning("layer %d %s: %s; computing those deltas in torch", layer, group, e)
            self.fallbacks += 1
            delta = self._torch_deltas(layer, spec, x_cold)
        return y.index_add_(0, self._rows, delta.to(y.device))

    def _torch_deltas(self, layer: int, spec: ProjectionGroup, x_cold: torch.Tensor) -> torch.Tensor:
        """What the workers compute, here: x · A · B · scaling per task's rows (the job's shard of A or
        B), float32, rounded once."""
        out = torch.zeros(x_cold.shape[0], spec.out_features, dtype=torch.float32, device=x_cold.device)
        for handle, r0, r1 in self._tasks:
            view = self._views.get(handle)
            if view is None:
                view = self._views[handle] = self.pool.arena.view(handle)
            x = x_cold[r0:r1].float()
            for p, column in spec.projections:
                if not view.ranks[p]:
                    continue
                a, bt = shard_tensors(view.a_rows[(layer, p)], view.b_rows[(layer, p)], spec.rank, spec.world,
                                      spec.row_parallel)
                a, bt = (t.to(x.device, torch.float32) for t in (a, bt))
                out[r0:r1, column:column + bt.shape[1]] = (x @ a.t()) @ bt * float(view.scaling[layer, p])
        return out.to(x_cold.dtype)

    @property
    def live(self) -> int:
        return self.pool.live

    @property
    def restarts(self) -> int:
        return self.pool.restarts

    def close(self) -> None:
        self.pool.close()


class CpuAssist(LayerAssist):
    """The serving process's (tensor-parallel rank 0's) assist: also the profile, which decides whether a
    cold adapter is assisted (``pays``) and how many workers each job of a step takes (``workers_for``)."""

    def __init__(self, arena: HostArena, config: ModelConfig, num_workers: int, dtype: torch.dtype,
                 device: torch.device, max_tokens: int, profile_dir: Path, weights=None, shard: Shard = Shard(0, 1),
                 cpus: list[int] | None = None):
        """weights: the model's LlamaWeights (the rank's shard), to time the device's projections; cpus: the
        cores this rank's threads and its workers share (tensor parallelism), else this process's."""
        super().__init__(arena, config, shard, num_workers, dtype, device, max_tokens, cpus)
        self.shapes = {g: [(fan_in, fan_out) for _, fan_in, fan_out, _ in rows]
                       for g, rows in group_layout(config).items()}
        self.cores = len(cpus) if cpus is not None else usable_cpus()
        try:
            self.profile = self._profile(profile_dir, max_tokens)
            self.device_s_per_token = self._device_seconds(weights, num_workers)
            self.copy_bytes_per_s = self._copy_rate()
        except BaseException:
            self.pool.close()
            raise

    # ---- profile (CaraServe §4.2) --------------------------------------------------------------

    def _profile(self, directory: Path, max_tokens: int) -> WorkerProfile:
        """The workers' fit for this CPU, model and dtype: cached, else measured now and cached, with
        the command that made it."""
        dtype = str(self.dtype).removeprefix("torch.")
        path = profile_path(directory, f"{cpu_model()} {self.config.name} {dtype}")
        if path.exists():
            try:
                return WorkerProfile.load(path)
            except (OSError, ValueError, TypeError) as e:
                log.warning("CPU worker profile %s is unreadable (%s); measuring again", path, e)
        hidden = self.config.hidden_size
        samples = measure(self.pool, in_features=hidden, out_features=hidden, ranks=PROFILE_RANKS,
                          token_counts=[t for t in PROFILE_TOKENS if t <= max_tokens] or [max_tokens], repeats=2)
        profile = fit(samples, command=f"{shlex.join(sys.argv)}  # at start-up, {self.pool.live} workers, "
                                       f"{hidden}x{hidden} {dtype} jobs")
        try:
            profile.save(path)
        except OSError as e:
            log.warning("cannot cache the CPU worker profile in %s: %s", path, e)
        log.info("CPU worker profile %s: %.0f us + %.1f ps/MAC + %.0f us/worker", path, profile.overhead_s * 1e6,
                 profile.per_mac_s * 1e12, profile.per_worker_s * 1e6)
        return profile

    def _device_seconds(self, weights, num_workers: int) -> dict[str, float]:
        """Per group, the device's base projection time per token: the window a job overlaps. Zero on a
        CPU device whose threads and the workers want more cores than there are: there they take
        turns, and a job adds all its time to the step."""
        if weights is None or (self.device.type == "cpu"
                               and torch.get_num_threads() + num_workers > self.cores):
            return dict.fromkeys(GROUPS, 0.0)
        layer, tokens, repeats = weights.layers[0], 128, 5
        linears: dict[str, Linear] = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down}
        out = {}
        for g, linear in linears.items():
            if linear is None:              # a mixture of experts without a dense MLP: no job runs there
                out[g] = 0.0
                continue
            x = torch.randn(tokens, self.groups[g].in_features, dtype=self.dtype, device=self.device)
            linear(x)
            self._sync()
            t0 = time.perf_counter()
            for _ in range(repeats):
                linear(x)
            self._sync()
            out[g] = (time.perf_counter() - t0) / repeats / tokens
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _copy_rate(self) -> float:
        """Bytes per second of a host -> device copy like the pager's page-in."""
        src = torch.empty(COPY_PROBE_BYTES // 4, dtype=torch.float32)
        dst = torch.empty_like(src, device=self.device)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            dst.copy_(src)
            self._sync()
            best = min(best, time.perf_counter() - t0)
        return COPY_PROBE_BYTES / max(best, 1e-9)

    def pays(self, ranks: list[int], tokens: int, load_seconds: float) -> bool:
        """``auto``: whether an adapter of these ranks (PROJECTIONS order) should be assisted for a
        chunk of ``tokens``: the workers' stall over all layer jobs is below ``load_seconds``, what
        waiting for its load would add."""
        jobs = []
        for g, projs in GROUPS.items():
            m = macs_per_token([ranks[PROJ_INDEX[p]] for p in projs], self.shapes[g])
            if m:
                jobs += [(m, self.device_s_per_token[g] * tokens)] * self.config.num_layers
        decision = should_assist(self.profile, tokens, jobs, load_seconds, self.pool.live)
        return decision.assist

    def copy_seconds(self, nbytes: int) -> float:
        return nbytes / self.copy_bytes_per_s

    def workers_for(self, tasks: list[tuple[AdapterHandle, int, int, list[int]]], rows: list[int]) -> int:
        """How many workers each job of a step with these cold rows takes (begin_step's tasks, rows): the
        profile's choice for the widest targeted group."""
        if not tasks:
            return 0
        g = max(targeted_groups(tasks), key=lambda g: self.groups[g].out_features)
        m = max(macs_per_token([ranks[PROJ_INDEX[p]] for p in GROUPS[g]], self.shapes[g]) for *_, ranks in tasks)
        return choose_workers(self.profile, len(rows), m, max(1, self.pool.live), self.device_s_per_token[g] * len(rows))


class AssistedLora:
    """The LoraHook forward() sees in a step with cold rows (CpuAssist.active): the device backend for
    warm rows (the cold segments carry seg_adapter -1), the workers' deltas for cold ones."""

    def __init__(self, assist: LayerAssist, backend: LoraBackend):
        self.assist, self.backend = assist, backend

    active = True

    def native_step(self) -> None:
        return None          # the workers' deltas join per layer, in project

    def experts(self):
        return self.backend.experts()       # an assisted adapter has none (Engine._assist_pays)

    def project(self, layer: int, group: str, x: torch.Tensor, base: Linear) -> torch.Tensor:
        backend = self.backend
        device_project = (lambda x: backend.project(layer, group, x, base)) if backend.active else base
        return self.assist.project(layer, group, x, device_project)


def default_workers(device: torch.device, torch_threads: int) -> int:
    """``--cpu-workers`` auto: the cores the device's own threads leave free (on a GPU box one stays
    with the server's thread), at most 8: a job's rows split thinner than that cost more in
    per-worker overhead than they save (ipc/profile.py's fit)."""
    cores = usable_cpus()
    spare = cores - 1 if device.type == "cuda" else cores - torch_threads
    return max(0, min(8, spare))
