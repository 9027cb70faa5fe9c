"""Profiling-guided parallelism (CaraServe §4.2): how long a layer job takes on the workers, and
whether and how wide to assist.

A job of T tokens split across k workers costs each worker ceil(T / k) · m multiply-adds, where
m = Σ_p rank_p · (in_p + out_p) over the group's projections (``macs_per_token``). The model

    seconds = overhead + per_mac · ceil(T / k) · m + per_worker · k

is fitted by least squares to measured jobs. It does not depend on the base model beyond m, so
one profile per CPU model serves every model; ``python -m ipc.profile --out DIR`` records one
(with the command that made it) as DIR/<cpu model>.json.

Decision (the ``auto`` mode): while an adapter loads, each layer job of its prefill overlaps the
device's own computation of that group (``device_seconds``); the workers delay the step only by
what they take beyond it, and by at least each job's fixed cost, which the server thread pays.
Assisting pays when that total stall is below the load time the request would otherwise wait.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ipc.arena import HostArena
from ipc.pool import ProjectionGroup, WorkerPool


@dataclass
class WorkerProfile:
    overhead_s: float
    per_mac_s: float
    per_worker_s: float
    cpu_model: str
    command: str = ""
    samples: list[dict] = field(default_factory=list)

    def predict(self, tokens: int, macs_per_token: float, workers: int) -> float:
        return self.overhead_s + self.per_mac_s * math.ceil(tokens / workers) * macs_per_token \
            + self.per_worker_s * workers

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> WorkerProfile:
        return cls(**json.loads(path.read_text()))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def profile_path(directory: Path, cpu: str | None = None) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", cpu or cpu_model()).strip("-").lower()
    return directory / f"{slug}.json"


def macs_per_token(ranks: list[int], shapes: list[tuple[int, int]]) -> int:
    """m of a job: Σ rank · (in + out) over its projections; shapes[i] = (in, out)."""
    return sum(r * (fi + fo) for r, (fi, fo) in zip(ranks, shapes))


def measure(pool: WorkerPool, *, in_features: int, out_features: int, ranks=(8, 32, 64),
            token_counts=(16, 64, 256), worker_counts=None, repeats: int = 3) -> list[dict]:
    """Time jobs of one projection [in -> out] for every rank x tokens x workers (best of repeats)."""
    arena: HostArena = pool.arena
    worker_counts = worker_counts or range(1, pool.live + 1)
    group = ProjectionGroup(in_features, out_features, ((0, 0),))
    samples = []
    for r in ranks:
        handle = arena.store([r], torch.ones(1, 1), {(0, 0): torch.randn(r, in_features).to(pool.dtype)},
                             {(0, 0): torch.randn(r, out_features).to(pool.dtype)})
        try:
            for tokens in token_counts:
                x = torch.randn(tokens, in_features).to(pool.dtype)
                for k in worker_counts:
                    best = math.inf
                    for _ in range(repeats + 1):          # the first run warms up
                        t0 = time.perf_counter()
                        used = pool.submit(0, group, x, [(handle, 0, tokens)], workers=k)
                        pool.collect(timeout=30.0)
                        best = min(best, time.perf_counter() - t0)
                    samples.append({"tokens": tokens, "rank": r, "workers": used, "seconds": best,
                                    "macs_per_token": macs_per_token([r], [(in_features, out_features)])})
        finally:
            arena.release(handle)
    return samples


def fit(samples: list[dict], cpu: str | None = None, command: str = "") -> WorkerProfile:
    rows = np.array([[1.0, math.ceil(s["tokens"] / s["workers"]) * s["macs_per_token"], s["workers"]]
                     for s in samples])
    seconds = np.array([s["seconds"] for s in samples])
    coef = np.maximum(np.linalg.lstsq(rows, seconds, rcond=None)[0], 0.0)
    return WorkerProfile(float(coef[0]), float(coef[1]), float(coef[2]), cpu or cpu_model(), command, samples)


def choose_workers(profile: WorkerProfile, tokens: int, macs: float, available: int,
                   budget_s: float | None = None) -> int:
    """Fewest workers whose predicted job time fits ``budget_s`` (CaraServe: ceil(T / per-core tokens));
    without a budget, or if none fits, the count with the lowest prediction."""
    counts = range(1, max(1, min(available, tokens)) + 1)
    if budget_s is not None:
        for k in counts:
            if profile.predict(tokens, macs, k) <= budget_s:
                return k
    return min(counts, key=lambda k: profile.predict(tokens, macs, k))


@dataclass
class AssistDecision:
    assist: bool
    workers: int
    stall_s: float            # predicted delay the workers add to the prefill


def should_assist(profile: WorkerProfile, tokens: int, jobs: list[tuple[float, float]], load_seconds: float,
                  available: int) -> AssistDecision:
    """jobs: (macs_per_token, device_seconds) of every layer job of the prefill, device_seconds being
    the device's own time for that group (the window a job overlaps). Assist when the stall it adds
    is below ``load_seconds``, the wait for the adapter's load otherwise. A job's fixed cost
    (overhead_s: x into shared memory, the signals, adding the deltas) is the server thread's own
    and never overlaps."""
    if available < 1 or tokens < 1:
        return AssistDecision(False, 0, math.inf)

    def stall(k: int) -> float:
        return sum(max(profile.overhead_s, profile.predict(tokens, m, k) - device_s) for m, device_s in jobs)

    k = min(range(1, min(available, tokens) + 1), key=lambda k: (stall(k), k))
    return AssistDecision(stall(k) < load_seconds, k, stall(k))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Measure the CPU LoRA workers and write DIR/<cpu model>.json")
    ap.add_argument("--out", type=Path, required=True, help="folder of cached profiles")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--in-features", type=int, default=2048)
    ap.add_argument("--out-features", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    with HostArena(64 << 20, slots=8) as arena, WorkerPool(
            arena, args.workers, max_tokens=256, max_in=args.in_features, max_out=args.out_features,
            dtype=dtype) as pool:
        if pool.wait_ready(120) < 1:
            sys.exit("no CPU LoRA worker started")
        samples = measure(pool, in_features=args.in_features, out_features=args.out_features)
    command = shlex.join([sys.executable, "-m", "ipc.profile", *(argv if argv is not None else sys.argv[1:])])
    profile = fit(samples, command=command)
    path = profile_path(args.out)
    profile.save(path)
    print(f"{path}: {profile.overhead_s * 1e6:.0f} us + {profile.per_mac_s * 1e12:.1f} ps/MAC + "
          f"{profile.per_worker_s * 1e6:.0f} us/worker ({len(samples)} jobs)")


if __name__ == "__main__":
    main()
