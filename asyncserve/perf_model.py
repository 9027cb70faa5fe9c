"""Rank-aware step-latency model (CaraServe §5) and the pending time of a queue (dLoRA §5.1).

A step runs `tokens` tokens (decodes and prefill chunks) of sequences whose adapters have ranks r_i.
Its time is modelled as

    seconds = beta + alpha_token * tokens + alpha_rank * rank_work
            + alpha_seq * sequences + alpha_adapter * adapters + alpha_attn * attention

where rank_work is CaraServe's rank term generalised from decode-only batches to chunks of n_i tokens:
    "sum" (padding-free kernels: MBGMV, SGMV, our stacked GEMMs)   rank_work = sum_i n_i * r_i
    "max" (padded BGMV)                                             rank_work = (sum_i n_i) * max_i r_i
For a decode-only batch S these are CaraServe's alpha * Sum(rank) + beta and alpha * |S| * Max(rank) + beta.
The other terms are what CaraServe's decode-only fit leaves out and a mixed step on a CPU shows
(scripts/bench_step_model.py): each sequence's own work (its sampled row through the LM head, its
attention call), each distinct adapter's (a LoRA turn or a segment of the stacked GEMMs), and
attention's quadratic part, attention = sum_i n_i * (context_i + (n_i + 1) / 2) query-key pairs for
a chunk of n_i tokens after context_i cached ones, averaged over the layers: a sliding-window layer
(Gemma's, Mistral's) reads a token's last `window` keys at most, min(position + 1, window) pairs, not
the whole context. Chunks given as (tokens, rank) alone count no context and one adapter per distinct rank. Fitted by least squares on the relative error, so that
short decode steps weigh as much as long prefill steps.

The pending time of a queue is the sum of each request's additive share of the steps it will be in
(dLoRA's "estimated queuing time"): each of its tokens costs alpha_token + alpha_rank * r, each
decode token also alpha_seq and its share beta / batch of the step's fixed cost, and its attention
pairs alpha_attn each, counted by the step model's own rule (attention_pairs: after the context it
has computed already, over the layers' windows) (an adapter's cost per step is shared by requests the
queue does not name together, so it is left out). Adapter loads are priced
by tier: host memory -> pool per unit of rank, disk -> pool with a fixed cost on top.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, NamedTuple, Sequence

import msgspec
import numpy as np

RANK_COSTS = ("sum", "max")


class PerfCoefficients(msgspec.Struct, frozen=True):
    beta: float                        # seconds per step, whatever it holds
    alpha_token: float                 # seconds per token in the step
    alpha_rank: float                  # seconds per unit of rank work
    rank_cost: str = "sum"             # how rank work is counted (RANK_COSTS)
    alpha_seq: float = 0.0             # seconds per sequence (chunk) in the step
    alpha_adapter: float = 0.0         # seconds per distinct adapter in the step
    alpha_attn: float = 0.0            # seconds per attended query-key pair
    load_host_s_per_rank: float = 0.0  # paging an adapter from host memory into the pool, per unit of rank
    load_disk_s_per_rank: float = 0.0  # reading it from disk first, per unit of rank ...
    load_disk_fixed_s: float = 0.0     # ... plus a fixed cost (open, parse, allocate)
    r2: float | None = None            # coefficient of determination of the fit, when fitted
    source: str = ""                   # where the numbers come from


# A node's step model until it has fitted its own steps: a guess, several times off on a slow CPU.
STEP_TIME_PRIOR = PerfCoefficients(beta=0.02, alpha_token=2e-4, alpha_rank=0.0, source="prior")


class StepChunk(NamedTuple):
    """One sequence's part of a step, as the model sees it; a (tokens, rank) tuple is one too."""
    tokens: int
    rank: int = 0                      # its adapter's rank (0: base model, or merged)
    context: int = 0                   # tokens whose KV is cached before them (their attention reads those too)
    adapter: object = None             # which adapter (any hashable id), to count a step's distinct ones


class StepSample(NamedTuple):
    tokens: int
    rank_work: float
    seconds: float
    sequences: int = 0
    adapters: int = 0
    attention: float = 0.0


FEATURES = ("beta", "alpha_token", "alpha_rank", "alpha_seq", "alpha_adapter", "alpha_attn")   # a sample's columns


class QueuedWork(NamedTuple):
    """A request's remaining work as a queue estimate sees it."""
    prefill_tokens: int                # tokens still to prefill (the prompt, or prompt + output after a migration)
    decode_tokens: int                 # expected output tokens still to generate
    rank: int                          # its adapter's rank (0: base model)
    context: int = 0                   # tokens whose KV is computed already (the remaining tokens attend to them)


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


def attention_pairs(tokens: int, context: int, windows: Sequence[int | None] = ()) -> float:
    """Query-key pairs a chunk of `tokens` after `context` cached ones reads per layer, averaged over
    the layers' windows (None: global; no windows: every layer global). The token at position p reads
    p + 1 keys, min(p + 1, window) in a sliding-window layer."""
    full = tokens * (context + (tokens + 1) / 2)
    if not windows:
        return full
    pairs = 0.0
    for window, layers in Counter(windows).items():
        if window is None or context + tokens <= window:
            pairs += layers * full
        else:    # positions up to the window read all keys before them, the rest `window` each
            inside = max(window - context, 0)
            pairs += layers * (inside * (context + (inside + 1) / 2) + (tokens - inside) * window)
    return pairs / len(windows)


def step_sample(chunks: Iterable[tuple], seconds: float, rank_cost: str = "sum",
                windows: Sequence[int | None] = ()) -> StepSample:
    """A step's terms (see the module's docstring) from its chunks: StepChunks or (tokens, rank) tuples;
    windows: the model's per-layer attention windows (None: global; empty: every layer global)."""
    chunks = [c if type(c) is StepChunk else StepChunk(*c) for c in chunks]
    adapters = {c.adapter if c.adapter is not None else ("rank", c.rank) for c in chunks if c.rank > 0}
    return StepSample(sum(c.tokens for c in chunks), rank_work([(c.tokens, c.rank) for c in chunks], rank_cost),
                      seconds, len(chunks), len(adapters),
                      float(sum(attention_pairs(c.tokens, c.context, windows) for c in chunks)))


def _columns(s: StepSample) -> tuple[float, ...]:
    return (1.0, s.tokens, s.rank_work, s.sequences, s.adapters, s.attention)       # FEATURES' order


def sample_seconds(c: PerfCoefficients, s: StepSample) -> float:
    """The model's seconds for a step's terms."""
    return sum(getattr(c, name) * x for name, x in zip(FEATURES, _columns(s)))


def step_seconds(c: PerfCoefficients, tokens: int, work: float, sequences: int = 0, adapters: int = 0,
                 attention: float = 0.0) -> float:
    return sample_seconds(c, StepSample(tokens, work, 0.0, sequences, adapters, attention))


def predict_step_seconds(c: PerfCoefficients, chunks: Iterable[tuple], windows: Sequence[int | None] = ()) -> float:
    """Predicted seconds of a step made of chunks: StepChunks or (num_tokens, rank) tuples (windows: step_sample's)."""
    return sample_seconds(c, step_sample(chunks, 0.0, c.rank_cost, windows))


def decode_step_seconds(c: PerfCoefficients, batch: int, rank_sum: int, max_rank: int) -> float:
    """A decode-only step of `batch` sequences whose ranks sum to rank_sum, the largest max_rank (their
    contexts and distinct adapters unknown: counted as none)."""
    work = rank_sum if c.rank_cost == "sum" else batch * max_rank
    return step_seconds(c, batch, work, sequences=batch, attention=float(batch))


def fit(samples: Iterable[StepSample], rank_cost: str = "sum", **extra) -> PerfCoefficients:
    """Least-squares fit of the coefficients (FEATURES) to measured steps, on the relative error.

    A term the samples never exercise (all zero) is held at zero; so is one the data would make
    negative (noise, or a term confounded with another), and the rest refitted, so predictions never
    fall as work grows."""
    if rank_cost not in RANK_COSTS:
        raise ValueError(f"rank_cost must be one of {RANK_COSTS}, got {rank_cost!r}")
    samples = list(samples)
    rows = np.array([_columns(s) for s in samples], dtype=np.float64)      # [n, features]
    secs = np.array([s.seconds for s in samples], dtype=np.float64)        # [n]
    if len(rows) < 2:
        raise ValueError("need at least two samples to fit")
    # each row over its seconds: the squares summed are those of the relative errors
    scaled = rows / np.maximum(secs, 1e-12)[:, None]
    ones = np.ones(len(secs))
    active = [j for j in range(rows.shape[1]) if rows[:, j].any()]
    while True:
        coef, *_ = np.linalg.lstsq(scaled[:, active], ones, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(rows.shape[1])
    full[active] = np.maximum(coef, 0.0)
    resid = secs - rows @ full
    total = float(((secs - secs.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / total if total > 0 else 1.0
    return PerfCoefficients(**dict(zip(FEATURES, map(float, full))), rank_cost=rank_cost, r2=r2, **extra)


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


def request_work_seconds(c: PerfCoefficients, work: QueuedWork, batch: int, batch_max_rank: int = 0,
                         windows: Sequence[int | None] = ()) -> float:
    """A request's additive share of the steps that will run its remaining tokens (windows: the
    model's per-layer attention windows, as step_sample's)."""
    r = work.rank if c.rank_cost == "sum" else max(work.rank, batch_max_rank)
    per_token = c.alpha_token + c.alpha_rank * r
    p, d = work.prefill_tokens, work.decode_tokens
    # attention: the prefill's and then each decode token's pairs, after the context computed already;
    # pairs add up over chunks, so all remaining tokens as one chunk count what their steps will
    attention = attention_pairs(p + d, work.context, windows)
    return (p * per_token + d * (per_token + c.alpha_seq + c.beta / max(batch, 1))
            + c.alpha_attn * attention)


def pending_seconds(c: PerfCoefficients, queue: Iterable[QueuedWork], max_running: int,
                    windows: Sequence[int | None] = ()) -> float:
    """Predicted time to drain a node's running and waiting requests (sum of their work shares,
    with the batch as full as the queue allows)."""
    queue = list(queue)
    if not queue:
        return 0.0
    batch = min(len(queue), max_running)
    max_rank = max(w.rank for w in queue)
    return sum(request_work_seconds(c, w, batch, max_rank, windows) for w in queue)


def drain_seconds(c: PerfCoefficients, runnable: list[QueuedWork], parked: list[QueuedWork], fetch_s: float,
                  max_running: int, windows: Sequence[int | None] = ()) -> float:
    """Predicted time to drain a node whose `parked` requests wait `fetch_s` for their adapters to be
    read from disk: no sooner than all its work, nor than the reads plus the parked requests' work.
    The reads overlap the runnable work (adding them on top would show a busy node's reads as an
    imbalance that moving requests cannot remove: migration thrash in the simulator)."""
    everything = pending_seconds(c, runnable + parked, max_running, windows)
    return max(everything, fetch_s + pending_seconds(c, parked, max_running, windows)) if parked else everything


class StepLatencyModel:
    """The engine's live step-time model: starts from given coefficients (a step profile of this
    device and model, or the prior) and refits them from the steps it is shown, over a sliding
    window of recent steps.

    The first steps (kernel set-up, first page-ins: seconds instead of milliseconds) are not shown
    to the fit, and a step far slower than the fit predicts (a stall of the machine) is dropped
    before one refit. While all recorded steps look alike, the coefficients it has are kept; a term
    the window's steps never exercise (no adapter in them, say) keeps the value it had, which the
    fit of the others does not depend on. attention_windows: the model's per-layer windows (step_sample's)."""

    def __init__(self, prior: PerfCoefficients, window: int = 512, refit_every: int = 64, warmup: int = 8,
                 attention_windows: Sequence[int | None] = ()):
        self.coefficients = prior
        self.attention_windows = list(attention_windows)
        self.start = prior                 # where it started (its source says from what)
        self._start_measured = False       # start_from a step profile: measured on this device
        self.window = window
        self.refit_every = refit_every
        self._skip = warmup
        self._samples: list[StepSample] = []
        self._token_counts: Counter[int] = Counter()   # the window's samples by their tokens (is a fit due?)
        self._since_fit = 0

    def start_from(self, coefficients: PerfCoefficients) -> None:
        """Start from a step profile's coefficients (measured on this device), before any step is recorded."""
        self.coefficients = self.start = coefficients
        self._start_measured = True

    def predict(self, chunks: Iterable[tuple]) -> float:
        return predict_step_seconds(self.coefficients, chunks, self.attention_windows)

    @property
    def measured(self) -> bool:
        """Whether the coefficients are measured on this device: refitted from its steps, or set from a
        profile (not the prior's guess)."""
        return self._start_measured or self.coefficients is not self.start

    def record(self, chunks: list[tuple], seconds: float) -> None:
        if self._skip > 0:
            self._skip -= 1
            return
        sample = step_sample(chunks, seconds, self.coefficients.rank_cost, self.attention_windows)
        self._samples.append(sample)
        self._token_counts[sample.tokens] += 1
        if len(self._samples) > self.window:
            dropped = self._samples.pop(0).tokens
            self._token_counts[dropped] -= 1
            if not self._token_counts[dropped]:
                del self._token_counts[dropped]
        self._since_fit += 1
        # steps of 3 sizes at least (a decode-only stretch has one: this is not a set built every step)
        if self._since_fit >= self.refit_every and len(self._token_counts) >= 3:
            self._since_fit = 0
            self.coefficients = self._fit(self._samples)
            typical = [s for s in self._samples if s.seconds <= 3 * sample_seconds(self.coefficients, s)]
            if len({s.tokens for s in typical}) >= 3:
                self.coefficients = self._fit(typical)

    def _fit(self, samples: list[StepSample]) -> PerfCoefficients:
        c = self.coefficients
        fitted = fit(samples, c.rank_cost, load_host_s_per_rank=c.load_host_s_per_rank,
                     load_disk_s_per_rank=c.load_disk_s_per_rank, load_disk_fixed_s=c.load_disk_fixed_s,
                     source="fitted online")
        idle = [name for name, column in zip(FEATURES, zip(*map(_columns, samples))) if not any(column)]
        return msgspec.structs.replace(fitted, **{name: getattr(c, name) for name in idle})
