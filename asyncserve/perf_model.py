"""Rank-aware step-latency model (CaraServe §5) and the pending time of a queue (dLoRA §5.1).

A step runs `tokens` tokens (decodes and prefill chunks) of sequences whose adapters have ranks r_i.
Its time is modelled as

    seconds = beta + alpha_token * tokens + alpha_rank * rank_work

where rank_work is CaraServe's rank term generalised from decode-only batches to chunks of n_i tokens:
    "sum" (padding-free kernels: MBGMV, SGMV, our stacked GEMMs)   rank_work = sum_i n_i * r_i
    "max" (padded BGMV)                                             rank_work = (sum_i n_i) * max_i r_i
For a decode-only batch S these are CaraServe's alpha * Sum(rank) + beta and alpha * |S| * Max(rank) + beta.

The pending time of a queue is the sum of each request's additive share of the steps it will be in
(dLoRA's "estimated queuing time"): each of its tokens costs alpha_token + alpha_rank * r, and each
decode token also carries its share beta / batch of the step's fixed cost. Adapter loads are priced
by tier: host memory -> pool per unit of rank, disk -> pool with a fixed cost on top.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import msgspec
import numpy as np

RANK_COSTS = ("sum", "max")


class PerfCoefficients(msgspec.Struct, frozen=True):
    beta: float                        # seconds per step, whatever it holds
    alpha_token: float                 # seconds per token in the step
    alpha_rank: float                  # seconds per unit of rank work
    rank_cost: str = "sum"             # how rank work is counted (RANK_COSTS)
    load_host_s_per_rank: float = 0.0  # paging an adapter from host memory into the pool, per unit of rank
    load_disk_s_per_rank: float = 0.0  # reading it from disk first, per unit of rank ...
    load_disk_fixed_s: float = 0.0     # ... plus a fixed cost (open, parse, allocate)
    r2: float | None = None            # coefficient of determination of the fit, when fitted
    source: str = ""                   # where the numbers come from


# A node's step model until it has fitted its own steps: a guess, several times off on a slow CPU.
STEP_TIME_PRIOR = PerfCoefficients(beta=0.02, alpha_token=2e-4, alpha_rank=0.0, source="prior")


class StepSample(NamedTuple):
    tokens: int
    rank_work: float
    seconds: float


class QueuedWork(NamedTuple):
    """A request's remaining work as a queue estimate sees it."""
    prefill_tokens: int                # tokens still to prefill (the prompt, or prompt + output after a migration)
    decode_tokens: int                 # expected output tokens still to generate
    rank: int                          # its adapter's rank (0: base model)


def rank_work(chunks: Iterable[tuple[int, int]], rank_cost: str = "sum") -> float:
    """Rank work of a step from its (num_tokens, rank) chunks."""
    if rank_cost == "sum":
        return float(sum(n * r for n, r in chunks))
    if rank_cost == "max":
        tokens = max_rank = 0
        for n, r in chunks:
            tokens += n
            max_rank = max(max_rank, r)
        return float(tokens * max_rank)
    raise ValueError(f"rank_cost must be one of {RANK_COSTS}, got {rank_cost!r}")


def step_seconds(c: PerfCoefficients, tokens: int, work: float) -> float:
    return c.beta + c.alpha_token * tokens + c.alpha_rank * work


def predict_step_seconds(c: PerfCoefficients, chunks: Iterable[tuple[int, int]]) -> float:
    """Predicted seconds of a step made of (num_tokens, rank) chunks."""
    chunks = list(chunks)
    return step_seconds(c, sum(n for n, _ in chunks), rank_work(chunks, c.rank_cost))


def decode_step_seconds(c: PerfCoefficients, batch: int, rank_sum: int, max_rank: int) -> float:
    """A decode-only step of `batch` sequences whose ranks sum to rank_sum, the largest max_rank."""
    work = rank_sum if c.rank_cost == "sum" else batch * max_rank
    return step_seconds(c, batch, work)


def fit(samples: Iterable[StepSample], rank_cost: str = "sum", **extra) -> PerfCoefficients:
    """Least-squares fit of beta, alpha_token, alpha_rank to measured steps.

    A coefficient the data would make negative (noise, or a term the data does not exercise) is
    held at zero and the rest refitted, so predictions never fall as work grows."""
    if rank_cost not in RANK_COSTS:
        raise ValueError(f"rank_cost must be one of {RANK_COSTS}, got {rank_cost!r}")
    rows = np.array([(1.0, s.tokens, s.rank_work) for s in samples], dtype=np.float64)   # [n, 3]
    secs = np.array([s.seconds for s in samples], dtype=np.float64)                     # [n]
    if len(rows) < 2:
        raise ValueError("need at least two samples to fit")
    active = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(rows[:, active], secs, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(3)
    full[active] = np.maximum(coef, 0.0)
    resid = secs - rows @ full
    total = float(((secs - secs.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / total if total > 0 else 1.0
    return PerfCoefficients(beta=float(full[0]), alpha_token=float(full[1]), alpha_rank=float(full[2]),
                            rank_cost=rank_cost, r2=r2, **extra)


def adapter_load_seconds(c: PerfCoefficients, rank: int, tier: str | None) -> float:
    """Time to make an adapter usable from the tier it is in: "device" (resident), "host" or None (disk)."""
    if tier == "device" or rank == 0:
        return 0.0
    host = c.load_host_s_per_rank * rank
    if tier == "host":
        return host
    return host + c.load_disk_fixed_s + c.load_disk_s_per_rank * rank


def fetch_backlog_seconds(c: PerfCoefficients, cold_ranks: list[int], fetchers: int) -> float:
    """Time until the adapters waiting to be read from disk (their ranks) are all loaded, `fetchers`
    of them at a time: what a request parked behind them waits before its own work starts."""
    return sum(adapter_load_seconds(c, rank, None) for rank in cold_ranks) / max(fetchers, 1)


def expected_remaining_tokens(generated: int, mean_output: float, max_tokens: int) -> int:
    """Output tokens a request is expected still to generate, its true length being unknown.

    Mean output length minus what it has generated, floored at a quarter of the mean: lengths are
    long-tailed, so a request past the mean is likely to run on rather than stop at once."""
    left = max(mean_output - generated, 0.25 * mean_output, 1.0)
    return int(min(left, max(max_tokens - generated, 1)))


def request_work_seconds(c: PerfCoefficients, work: QueuedWork, batch: int, batch_max_rank: int = 0) -> float:
    """A request's additive share of the steps that will run its remaining tokens."""
    r = work.rank if c.rank_cost == "sum" else max(work.rank, batch_max_rank)
    per_token = c.alpha_token + c.alpha_rank * r
    return work.prefill_tokens * per_token + work.decode_tokens * (per_token + c.beta / max(batch, 1))


def pending_seconds(c: PerfCoefficients, queue: Iterable[QueuedWork], max_running: int) -> float:
    """Predicted time to drain a node's running and waiting requests (sum of their work shares,
    with the batch as full as the queue allows)."""
    queue = list(queue)
    if not queue:
        return 0.0
    batch = min(len(queue), max_running)
    max_rank = max(w.rank for w in queue)
    return sum(request_work_seconds(c, w, batch, max_rank) for w in queue)


def drain_seconds(c: PerfCoefficients, runnable: list[QueuedWork], parked: list[QueuedWork], fetch_s: float,
                  max_running: int) -> float:
    """Predicted time to drain a node whose `parked` requests wait `fetch_s` for their adapters to be
    read from disk: no sooner than all its work, nor than the reads plus the parked requests' work.
    The reads overlap the runnable work (adding them on top would show a busy node's reads as an
    imbalance that moving requests cannot remove: migration thrash in the simulator)."""
    everything = pending_seconds(c, runnable + parked, max_running)
    return max(everything, fetch_s + pending_seconds(c, parked, max_running)) if parked else everything


class StepLatencyModel:
    """The engine's live step-time model: starts from given coefficients (a cached profile, or a
    prior) and refits them from the steps it is shown, over a sliding window of recent steps.

    The first steps (kernel set-up, first page-ins: seconds instead of milliseconds) are not shown
    to the fit, and a step far slower than the fit predicts (a stall of the machine) is dropped
    before one refit. While all recorded steps look alike, the coefficients it has are kept."""

    def __init__(self, prior: PerfCoefficients, window: int = 512, refit_every: int = 64, warmup: int = 8):
        self.coefficients = prior
        self._prior = prior
        self.window = window
        self.refit_every = refit_every
        self._skip = warmup
        self._samples: list[StepSample] = []
        self._since_fit = 0

    def predict(self, chunks: Iterable[tuple[int, int]]) -> float:
        return predict_step_seconds(self.coefficients, chunks)

    @property
    def measured(self) -> bool:
        """Whether the coefficients are no longer the prior (refitted from steps, or set from a profile)."""
        return self.coefficients is not self._prior

    def record(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        if self._skip > 0:
            self._skip -= 1
            return
        tokens = sum(n for n, _ in chunks)
        self._samples.append(StepSample(tokens, rank_work(chunks, self.coefficients.rank_cost), seconds))
        del self._samples[:-self.window]
        self._since_fit += 1
        if self._since_fit >= self.refit_every and len({s.tokens for s in self._samples}) >= 3:
            self._since_fit = 0
            self.coefficients = self._fit(self._samples)
            typical = [s for s in self._samples
                       if s.seconds <= 3 * step_seconds(self.coefficients, s.tokens, s.rank_work)]
            if len({s.tokens for s in typical}) >= 3:
                self.coefficients = self._fit(typical)

    def _fit(self, samples: list[StepSample]) -> PerfCoefficients:
        c = self.coefficients
        return fit(samples, c.rank_cost, load_host_s_per_rank=c.load_host_s_per_rank,
                   load_disk_s_per_rank=c.load_disk_s_per_rank, load_disk_fixed_s=c.load_disk_fixed_s,
                   source="fitted online")
