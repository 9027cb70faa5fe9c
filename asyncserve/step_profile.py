"""Steps of chosen shapes run on a real engine and timed: what the step-time model (perf_model.py)
is fitted to and checked against (scripts/bench_step_model.py, tests/test_step_model.py), and the
step profile an engine starts its model from (``starting_coefficients``, at the end).

A step is described by its chunks (tokens computed, tokens already cached before them, adapter).
``timed_step`` makes one sequence per chunk with KV pages of its own (their contents do not change
the time), runs the plan through the engine's runner ``repeats`` times (a plan's run changes no state:
it rewrites the same KV rows and samples the same tokens) and keeps the fastest run, so a run that
the machine preempted does not count. ``random_step`` draws the mixes a server sees: decode batches,
prefill chunks after some cached context, and decodes with a prefill chunk beside them.
"""
from __future__ import annotations

import logging
import os
import random
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec
import torch

import kernels.cpu as cpu_kernels
from asyncserve.lora.backend import PACK_AFTER_STEPS
from asyncserve.model.linear import NativeLinear, QuantLinear
from asyncserve.perf_model import (STEP_TIME_PRIOR, PerfCoefficients, StepChunk, StepSample, fit, sample_seconds,
                                   step_sample)
from asyncserve.model.config import ModelConfig
from asyncserve.progress import Progress
from asyncserve.sampling_params import SamplingParams
from asyncserve.sequence import Sequence
from asyncserve.step import ScheduledChunk, StepPlan, StepResult

log = logging.getLogger("asyncserve.step_profile")

STEP_KINDS = ("decode", "prefill", "mixed")
# a seed of its own: the engine's seed stream (config.seed) is left as it was
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, seed=0)
# steps the backend may take beyond PACK_AFTER_STEPS to pack and fuse a set (24 MiB a step: ~10 for
# SmolLM2's fused projections and four rank-64 adapters)
WARM_BUILD_STEPS = 16


class ProfiledEngine(Protocol):
    """What a profile uses of the engine (engine.py's Engine, which imports this module to start its
    step-time model from a profile)."""
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    lora_backend_name: str
    max_model_len: int

    @property
    def vocab_size(self) -> int: ...
    @property
    def max_running(self) -> int: ...
    @property
    def max_step_tokens(self) -> int: ...
    @property
    def lm_head(self) -> torch.nn.Module: ...
    def host_adapters(self) -> list[str]: ...
    def adapter_rank(self, name: str) -> int: ...
    def place_sequence(self, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
                       computed: int) -> Sequence: ...
    def release_placed(self, seq: Sequence) -> None: ...
    def run(self, plan: StepPlan) -> StepResult: ...


@dataclass(frozen=True)
class ChunkSpec:
    tokens: int              # computed this step (1: a decode)
    context: int             # tokens whose KV is cached before them
    adapter: str | None      # None: the base model


@dataclass(frozen=True)
class TimedStep:
    kind: str
    chunks: list[StepChunk]              # what the step-time model sees
    seconds: float                       # the fastest of the repeats


def random_step(rng: random.Random, kind: str, active: list[str], max_batch: int = 32,
                prefill_tokens: tuple[int, int] = (16, 512), max_context: int = 512) -> list[ChunkSpec]:
    """One step of ``kind`` whose adapters are exactly ``active`` (every one in some chunk; base-model
    chunks beside them): "decode" (1..max_batch decodes, at least one per adapter), "prefill" (one or
    two chunks, one per adapter if more, of prefill_tokens tokens between them, after a cached
    context or none) or "mixed" (decodes and a prefill chunk). Decodes come first, grouped by
    adapter, as the scheduler plans them."""
    if kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {STEP_KINDS}, got {kind!r}")
    choices = [*active, None]

    def adapters(count: int) -> list[str | None]:      # every active adapter once, then any (or the base)
        return active[:count] + [rng.choice(choices) for _ in range(count - len(active))]

    decodes, prefills = [], []
    if kind == "decode" or kind == "mixed":
        batch = rng.randint(len(active) if kind == "decode" and active else 1, max(max_batch, len(active)))
        names = adapters(batch) if kind == "decode" else [rng.choice(choices) for _ in range(batch)]
        decodes = [ChunkSpec(1, rng.randint(1, max_context), name) for name in names]
    if kind == "prefill" or kind == "mixed":
        count = 1 if kind == "mixed" else max(rng.randint(1, 2), len(active))
        total = rng.randint(max(prefill_tokens[0], count), prefill_tokens[1])
        names = [rng.choice(choices)] if kind == "mixed" else adapters(count)
        for i, name in enumerate(names):
            context = rng.choice([0, 0, rng.randint(1, max_context)])
            prefills.append(ChunkSpec(total // count + (i < total % count), context, name))
    if kind == "mixed":       # the decodes' adapters and the chunk's together cover the active set
        missing = [a for a in active if a not in {c.adapter for c in decodes + prefills}]
        decodes += [ChunkSpec(1, rng.randint(1, max_context), a) for a in missing]
    order = {name: i for i, name in enumerate(choices)}
    decodes.sort(key=lambda c: order[c.adapter])
    return decodes + prefills


def timed_step(engine: ProfiledEngine, kind: str, specs: list[ChunkSpec], repeats: int = 3) -> TimedStep:
    """Run the step ``repeats`` times on ``engine`` (which must be idle) and return its fastest run."""
    seqs = []
    try:
        for spec in specs:
            prompt = [1 + i % (engine.vocab_size - 1) for i in range(spec.context + spec.tokens)]   # any ids: same time
            seqs.append(engine.place_sequence(prompt, _GREEDY, spec.adapter, spec.context))
        chunks = [ScheduledChunk(seq, spec.tokens) for seq, spec in zip(seqs, specs)]
        nd = next((i for i, spec in enumerate(specs) if spec.tokens != 1), len(specs))   # the leading decodes
        plan = StepPlan(decodes=chunks[:nd], prefills=chunks[nd:])
        seconds = min(engine.run(plan).duration_s for _ in range(repeats))
    finally:
        for seq in seqs:
            engine.release_placed(seq)
    return TimedStep(kind, [StepChunk(s.tokens, seq.adapter_rank, s.context, s.adapter) for s, seq in zip(specs, seqs)],
                     seconds)


def warm_set(engine: ProfiledEngine, active: list[str]) -> None:
    """Run one-decode-per-adapter steps of ``active`` for as long as the LoRA backend takes to build,
    pack and fuse that set's stacks (it spreads the work over steps; see lora/backend.py): the steps
    timed next then measure the set's steady state, which a server runs nearly all its steps in."""
    if active:
        timed_step(engine, "decode", [ChunkSpec(1, 16, name) for name in active],
                   repeats=PACK_AFTER_STEPS + WARM_BUILD_STEPS)


def profile_steps(engine: ProfiledEngine, count: int, adapters: list[str], seed: int = 0, repeats: int = 3,
                  steps_per_set: int = 6, max_active: int = 5, **shape) -> list[TimedStep]:
    """``count`` random steps (see random_step; ``shape``: its sizes), the kinds in turn; every
    ``steps_per_set`` steps a new active set of 0..max_active of ``adapters`` is drawn and warmed
    (warm_set)."""
    rng = random.Random(seed)
    steps = []
    for i in range(count):
        if i % steps_per_set == 0:
            active = rng.sample(adapters, rng.randint(0, min(max_active, len(adapters))))
            warm_set(engine, active)
        kind = STEP_KINDS[i % len(STEP_KINDS)]
        steps.append(timed_step(engine, kind, random_step(rng, kind, active, **shape), repeats))
    return steps


@dataclass(frozen=True)
class Holdout:
    coefficients: PerfCoefficients       # fitted to the even-numbered steps
    errors: dict[str, list[float]]       # kind (and "all") -> |predicted / measured - 1| of the odd-numbered ones


def holdout(steps: list[TimedStep], caraserve_terms_only: bool = False) -> Holdout:
    """Fit the step-time model to half the steps (every other one, so both halves see every kind and
    active set) and measure its relative error on the other half. ``caraserve_terms_only``: fit
    beta, alpha_token and alpha_rank alone (CaraServe's model extended to chunks), for comparison."""
    samples = [step_sample(s.chunks, s.seconds) for s in steps]
    if caraserve_terms_only:
        samples = [StepSample(s.tokens, s.rank_work, s.seconds) for s in samples]
    coefficients = fit(samples[0::2], source="fitted to profiled steps")
    return Holdout(coefficients, relative_errors(coefficients, steps[1::2], samples[1::2]))


def relative_errors(coefficients: PerfCoefficients, steps: list[TimedStep],
                    samples: list[StepSample] | None = None) -> dict[str, list[float]]:
    """Kind (and "all") -> |predicted / measured - 1| of each step (``samples``: their terms, if not
    all of step_sample's)."""
    samples = samples or [step_sample(s.chunks, s.seconds) for s in steps]
    errors: dict[str, list[float]] = {"all": []}
    for step, sample in zip(steps, samples):
        error = abs(sample_seconds(coefficients, sample) / sample.seconds - 1)
        errors["all"].append(error)
        errors.setdefault(step.kind, []).append(error)
    return errors


# ---- the engine's step profile: where its step-time model starts ----------------------------------
#
# A short profile of the engine just built (its device, model, dtype, threads and LoRA backend):
# PROFILE_STEPS random steps, the kinds in turn, spread over the active sets: the base model alone,
# one adapter, and up to PROFILE_ADAPTERS together, of those in host memory at start (--adapter,
# pinned ones; the highest-ranked), each set warmed first and each step the fastest of
# PROFILE_REPEATS runs, within PROFILE_BUDGET_S (SmolLM2, bf16, 2 threads: 15 steps in 5.3 s);
# fitted with perf_model.fit. Sets of different sizes are what separate the
# per-adapter cost from the rest: with one adapter only (tiny model), the per-adapter term came out
# 7x the full fit's and the held-out error grew from 17% on base-model steps to 120% on steps of five
# adapters. Cached as JSON with the command that made it in Config.step_profile_dir, one file per
# key; a file shipped in SHIPPED_PROFILE_DIR (named step-<key>.json) serves when none is cached.
# The other files there are scripts/bench_kernels.py's operator fits (one LoRA operator at a hidden
# size, in microseconds; BENCHMARKS.md cites them): no step model can be made of them, and nothing
# here reads them.

SHIPPED_PROFILE_DIR = Path(__file__).resolve().parent / "lora" / "latency_models"
PROFILE_STEPS = 36             # in all, spread evenly over the active sets
PROFILE_ADAPTERS = 3           # the most adapters profiled (sets of 0, 1 and this many)
PROFILE_REPEATS = 2            # runs of each step; the fastest counts
PROFILE_BUDGET_S = 5.0         # past its share of this a set stops (once it has a step of each kind)
PROFILE_MAX_ERROR = 0.3        # a fit further off its own steps (median) is not cached
MEASURED, CACHED, SHIPPED = "step profile measured at start", "cached step profile", "shipped step profile"


class ProfileKey(msgspec.Struct, frozen=True):
    """What a step profile holds for: step times on anything else differ."""
    device: str                  # the CPU's model name, or the CUDA device's
    model: str                   # the model's name and shape (layers x hidden)
    dtype: str
    threads: int                 # torch threads on a CPU device (0 on a GPU, where they barely count)
    lora_backend: str
    # the projections' GEMM (linear.py's class; "+amx": the native one, or the quantized one's, on AMX
    # tiles): one CPU model name covers VMs with and without AMX exposed, 3x apart in step time
    # (BENCHMARKS.md, "Box E")
    gemm: str = ""

    def slug(self) -> str:
        text = f"{self.device} {self.model} {self.dtype} {self.threads}t {self.lora_backend} {self.gemm}"
        return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


class ProfiledStep(msgspec.Struct, array_like=True):
    kind: str
    chunks: list[tuple[int, int, int, str | None]]   # StepChunks: tokens, rank, context, adapter
    seconds: float


class StepProfile(msgspec.Struct):
    key: ProfileKey
    coefficients: PerfCoefficients
    adapter_ranks: list[int]     # of the adapters profiled (none: the rank and adapter terms are unmeasured)
    command: str                 # what started the engine that measured it
    created: str
    seconds: float               # the profile's wall time
    median_error: float          # of the fit over its own steps (absolute relative error)
    steps: list[ProfiledStep]


def profile_key(engine: ProfiledEngine) -> ProfileKey:
    from ipc.profile import cpu_model

    mc, device = engine.model_config, engine.device
    cpu = device.type == "cpu"
    lm_head = engine.lm_head
    amx = ((isinstance(lm_head, NativeLinear) and cpu_kernels.amx_gemm_available())
           or (isinstance(lm_head, QuantLinear) and cpu_kernels.quant_amx_available()))
    return ProfileKey(device=cpu_model() if cpu else torch.cuda.get_device_name(device),
                      model=f"{mc.name} {mc.num_layers}x{mc.hidden_size}",
                      dtype=str(engine.dtype).removeprefix("torch."), threads=torch.get_num_threads() if cpu else 0,
                      lora_backend=engine.lora_backend_name, gemm=type(lm_head).__name__ + ("+amx" if amx else ""))


def profile_file(directory: Path, key: ProfileKey, shipped: bool = False) -> Path:
    return directory / f"{'step-' if shipped else ''}{key.slug()}.json"


def read_profile(path: Path, key: ProfileKey) -> StepProfile:
    """The profile in ``path``; ValueError if it does not parse or holds for another key."""
    profile = msgspec.json.decode(path.read_bytes(), type=StepProfile)
    if profile.key != key:
        raise ValueError(f"it holds for {profile.key}, not {key}")
    return profile


def save_profile(path: Path, profile: StepProfile) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")        # two servers starting at once: whole files only
    partial.write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=1) + b"\n")
    partial.replace(path)


def profile_adapters(engine: ProfiledEngine) -> list[str]:
    """The adapters a profile runs: of those in host memory at start, the PROFILE_ADAPTERS highest-ranked."""
    ranked = sorted(engine.host_adapters(), key=lambda name: (-engine.adapter_rank(name), name))
    return ranked[:PROFILE_ADAPTERS]


def measure_profile(engine: ProfiledEngine, adapters: list[str], steps: int = PROFILE_STEPS,
                    repeats: int = PROFILE_REPEATS, budget_s: float = PROFILE_BUDGET_S,
                    seed: int = 2026) -> StepProfile:
    """Profile the idle ``engine`` (see above) with ``adapters`` (the first alone, then all). Set n of
    N ends at n / N of ``budget_s`` once it has a step of each kind; one not begun within the budget
    is left out."""
    t0 = time.perf_counter()
    hi = min(256, engine.max_step_tokens)
    shape = {"max_batch": min(32, engine.max_running), "prefill_tokens": (min(16, hi), hi),
             "max_context": max(1, min(256, engine.max_model_len - hi - 2))}
    rng = random.Random(seed)
    for kind in STEP_KINDS:                         # first-run costs
        timed_step(engine, kind, random_step(rng, kind, [], **shape), repeats=1)
    sets = [[], *([adapters[:1]] if adapters else []), *([adapters] if len(adapters) > 1 else [])]
    progress = Progress("measuring the step profile", "steps")
    planned = steps // len(sets) * len(sets)
    timed: list[TimedStep] = []
    profiled: list[str] = []
    for n, active in enumerate(sets, 1):
        if active and time.perf_counter() - t0 > budget_s:
            break
        warm_set(engine, active)
        profiled = active
        for i in range(steps // len(sets)):
            if i >= len(STEP_KINDS) and time.perf_counter() - t0 > budget_s * n / len(sets):
                break
            kind = STEP_KINDS[i % len(STEP_KINDS)]
            timed.append(timed_step(engine, kind, random_step(rng, kind, active, **shape), repeats))
            progress(len(timed), planned)
    progress.close()
    samples = [step_sample(s.chunks, s.seconds, windows=engine.layer_windows) for s in timed]
    coefficients = fit(samples, source="step profile")
    ranks = [engine.adapter_rank(name) for name in profiled]
    return StepProfile(
        key=profile_key(engine), coefficients=coefficients, adapter_ranks=ranks,
        command=f"{shlex.join(sys.argv)}  # at start-up: {len(timed)} steps, best of {repeats} runs, "
                f"adapters of ranks {ranks}",
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), seconds=time.perf_counter() - t0,
        median_error=statistics.median(relative_errors(coefficients, timed, samples)["all"]),
        steps=[ProfiledStep(s.kind, [tuple(c) for c in s.chunks], s.seconds) for s in timed])


def starting_coefficients(engine: ProfiledEngine, directory: Path) -> PerfCoefficients | None:
    """The step-time model's starting coefficients for ``engine`` (just built, idle): its key's
    profile cached in ``directory``, else shipped (SHIPPED_PROFILE_DIR), else measured now and
    cached. A cached file that is unreadable (warned), holds for another key or was made with fewer
    adapters than are in host memory now (up to PROFILE_ADAPTERS) is measured again; a measured fit
    off its own steps by more than PROFILE_MAX_ERROR is not cached, and serves only if the prior is
    further off them. The source says which, and the file. None: start from the prior (also when
    the profile cannot run here)."""
    key, adapters = profile_key(engine), profile_adapters(engine)
    cached, shipped = profile_file(directory, key), profile_file(SHIPPED_PROFILE_DIR, key, shipped=True)
    for path, source in ((cached, CACHED), (shipped, SHIPPED)):
        if not path.exists():
            continue
        try:
            profile = read_profile(path, key)
        except (OSError, ValueError) as e:
            log.warning("step profile %s is unreadable (%s); %s", path, e,
                        "measuring again" if source == CACHED else "not using it")
            continue
        if len(profile.adapter_ranks) < len(adapters):
            log.info("step profile %s was measured with %d adapters; measuring again with %d", path,
                     len(profile.adapter_ranks), len(adapters))
            continue
        log.info("step-time model from %s (%s)", path, profile.command)
        return msgspec.structs.replace(profile.coefficients, source=f"{source} {path}")
    try:
        profile = measure_profile(engine, adapters)
    except Exception as e:         # a pool too small for the shapes, say: the prior serves, as it did before
        log.warning("could not profile the steps (%s: %s); the step-time model starts from its prior",
                    type(e).__name__, e)
        return None
    c = profile.coefficients
    log.info("step profile measured in %.1f s (%d steps, median error %.0f%%): %.3f ms + %.2f us/token + "
             "%.2f ns/rank unit + %.1f us/sequence + %.1f us/adapter + %.2f ns/attended pair", profile.seconds,
             len(profile.steps), 100 * profile.median_error, 1e3 * c.beta, 1e6 * c.alpha_token,
             1e9 * c.alpha_rank, 1e6 * c.alpha_seq, 1e6 * c.alpha_adapter, 1e9 * c.alpha_attn)
    if profile.median_error > PROFILE_MAX_ERROR:
        # steps disturbed by other work on the machine: not kept for later starts
        prior_error = statistics.median(relative_errors(STEP_TIME_PRIOR, profile.steps)["all"])
        use = profile.median_error < prior_error
        log.warning("the step profile's fit is off its own steps by a median %.0f%% (the machine busy?): not "
                    "cached%s", 100 * profile.median_error,
                    "" if use else f"; the prior ({100 * prior_error:.0f}% off them) serves instead")
        return msgspec.structs.replace(c, source=f"{MEASURED} (not cached)") if use else None
    try:
        save_profile(cached, profile)
    except OSError as e:
        log.warning("cannot cache the step profile in %s: %s", cached, e)
    return msgspec.structs.replace(c, source=f"{MEASURED} {cached}")
