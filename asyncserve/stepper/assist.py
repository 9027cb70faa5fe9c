"""CPU-assisted LoRA (CaraServe §4): the CPU workers (ipc/) compute the LoRA of sequences whose adapter
is not on the device, from its host-tier copy, layer by layer beside the device's base projections.

    assist = CpuAssist(pager.arena, model_config, workers, dtype, device, max_tokens, profile_dir, weights)
    assist.begin_step(tasks, rows)      # per step: (host block, row0, row1, ranks) over the cold rows
    if assist.active:                   # the step has cold rows
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
from ipc import AdapterHandle, CpuAssistError, HostArena, ProjectionGroup, WorkerPool
from ipc.profile import (WorkerProfile, choose_workers, cpu_model, fit, macs_per_token, measure, profile_path,
                         should_assist)

log = logging.getLogger("asyncserve.assist")

JOB_TIMEOUT_S = 10.0                 # a job later than this is the workers' failure: recomputed here
READY_TIMEOUT_S = 60.0               # workers starting (a python with torch each)
PROFILE_RANKS = (8, 64)
PROFILE_TOKENS = (16, 128)
COPY_PROBE_BYTES = 8 << 20


class CpuAssist:
    def __init__(self, arena: HostArena, config: ModelConfig, num_workers: int, dtype: torch.dtype,
                 device: torch.device, max_tokens: int, profile_dir: Path, weights=None):
        """weights: the model's LlamaWeights, to time the device's projections (on a GPU)."""
        self.config, self.device, self.dtype = config, device, dtype
        layout = group_layout(config)
        self.groups = {g: ProjectionGroup(rows[0][1], sum(r[2] for r in rows),
                                          tuple((PROJ_INDEX[p], col) for p, _, _, col in rows))
                       for g, rows in layout.items()}
        self.shapes = {g: [(fan_in, fan_out) for _, fan_in, fan_out, _ in rows] for g, rows in layout.items()}
        self.pool = WorkerPool(arena, num_workers, max_tokens=max_tokens,
                               max_in=max(g.in_features for g in self.groups.values()),
                               max_out=max(g.out_features for g in self.groups.values()), dtype=dtype)
        self.tokens_total = 0            # tokens whose LoRA the workers computed
        self.fallbacks = 0               # layer jobs recomputed here after a worker failure
        try:
            if self.pool.wait_ready(READY_TIMEOUT_S) < 1:
                raise RuntimeError("no CPU LoRA worker started")
            self.profile = self._profile(profile_dir, max_tokens)
            self.device_s_per_token = self._device_seconds(weights, num_workers)
            self.copy_bytes_per_s = self._copy_rate()
        except BaseException:
            self.pool.close()
            raise
        self._tasks: list[tuple[AdapterHandle, int, int]] = []
        self._rows: torch.Tensor | None = None
        self._targets: set[str] = set()
        self._workers = 0
        self._views: dict[AdapterHandle, object] = {}

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
                               and torch.get_num_threads() + num_workers > usable_cpus()):
            return dict.fromkeys(GROUPS, 0.0)
        layer, tokens, repeats = weights.layers[0], 128, 5
        linears: dict[str, Linear] = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down}
        out = {}
        for g, linear in linears.items():
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

    # ---- steps (torch thread) ------------------------------------------------------------------

    def begin_step(self, tasks: list[tuple[AdapterHandle, int, int, list[int]]], rows: list[int]) -> None:
        """tasks: per cold run, (host block, first, end row among the cold rows, its ranks);
        rows: the step's token rows that are cold, in order."""
        self._tasks = [(h, r0, r1) for h, r0, r1, _ in tasks]
        self._views = {}
        if not tasks:
            self._rows = None
            return
        self._rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self._targets = {g for g, projs in GROUPS.items()
                         if any(ranks[PROJ_INDEX[p]] for *_, ranks in tasks for p in projs)}
        g = max(self._targets, key=lambda g: self.groups[g].out_features)
        m = max(macs_per_token([ranks[PROJ_INDEX[p]] for p in GROUPS[g]], self.shapes[g]) for *_, ranks in tasks)
        self._workers = choose_workers(self.profile, len(rows), m, max(1, self.pool.live),
                                       self.device_s_per_token[g] * len(rows))
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
        """What the workers compute, here: x · A · B · scaling per task's rows, float32, rounded once."""
        out = torch.zeros(x_cold.shape[0], spec.out_features, dtype=torch.float32, device=x_cold.device)
        for handle, r0, r1 in self._tasks:
            view = self._views.get(handle)
            if view is None:
                view = self._views[handle] = self.pool.arena.view(handle)
            x = x_cold[r0:r1].float()
            for p, column in spec.projections:
                if not view.ranks[p]:
                    continue
                a, bt = (t.to(x.device, torch.float32) for t in (view.a_rows[(layer, p)], view.b_rows[(layer, p)]))
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


class AssistedLora:
    """The LoraHook forward() sees in a step with cold rows (CpuAssist.active): the device backend for
    warm rows (the cold segments carry seg_adapter -1), the workers' deltas for cold ones."""

    def __init__(self, assist: CpuAssist, backend: LoraBackend):
        self.assist, self.backend = assist, backend

    active = True

    def native_step(self) -> None:
        return None          # the workers' deltas join per layer, in project

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
