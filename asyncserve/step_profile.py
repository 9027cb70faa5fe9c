"""Steps of chosen shapes run on a real engine and timed: what the step-time model (perf_model.py)
is fitted to and checked against (scripts/bench_step_model.py, tests/test_step_model.py).

A step is described by its chunks (tokens computed, tokens already cached before them, adapter).
``timed_step`` makes one sequence per chunk with KV pages of its own (their contents do not change
the time), runs the plan through the engine's runner ``repeats`` times (a plan's run changes no state:
it rewrites the same KV rows and samples the same tokens) and keeps the fastest run, so a run that
the machine preempted does not count. ``random_step`` draws the mixes a server sees: decode batches,
prefill chunks after some cached context, and decodes with a prefill chunk beside them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from asyncserve.engine import Engine
from asyncserve.lora.backend import PACK_AFTER_STEPS
from asyncserve.perf_model import PerfCoefficients, StepChunk, StepSample, fit, sample_seconds, step_sample
from asyncserve.sampling_params import SamplingParams
from asyncserve.step import ScheduledChunk, StepPlan

STEP_KINDS = ("decode", "prefill", "mixed")
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
# steps the backend may take beyond PACK_AFTER_STEPS to pack and fuse a set (24 MiB a step: ~10 for
# SmolLM2's fused projections and four rank-64 adapters)
WARM_BUILD_STEPS = 16


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


def timed_step(engine: Engine, kind: str, specs: list[ChunkSpec], repeats: int = 3) -> TimedStep:
    """Run the step ``repeats`` times on ``engine`` (which must be idle) and return its fastest run."""
    pool, pager = engine.pool, engine.pager
    seqs, chunks = [], []
    try:
        for spec in specs:
            prompt = [1 + i % (engine.vocab_size - 1) for i in range(spec.context + spec.tokens)]   # any ids: same time
            seq = engine.make_sequence(prompt, _GREEDY, spec.adapter)
            seq.block_table = pool.allocate(pool.pages_for_tokens(len(prompt)), "kv")
            seq.num_computed = spec.context
            seqs.append(seq)
            if spec.adapter is not None:
                if pager.ensure_resident(spec.adapter, admission=False) is None:
                    raise RuntimeError(f"adapter {spec.adapter!r} does not fit in the pool for profiling")
                pager.acquire(pager.registration(spec.adapter))
                seq.adapter_load = pager.registration(spec.adapter)
            chunks.append(ScheduledChunk(seq, spec.tokens))
        nd = next((i for i, spec in enumerate(specs) if spec.tokens != 1), len(specs))   # the leading decodes
        plan = StepPlan(decodes=chunks[:nd], prefills=chunks[nd:])
        seconds = min(engine.run(plan).duration_s for _ in range(repeats))
    finally:
        for seq in seqs:
            pool.release(seq.block_table)
            if seq.adapter_load is not None:
                pager.release(seq.adapter_load)
    return TimedStep(kind, [StepChunk(s.tokens, seq.adapter_rank, s.context, s.adapter) for s, seq in zip(specs, seqs)],
                     seconds)


def warm_set(engine: Engine, active: list[str]) -> None:
    """Run one-decode-per-adapter steps of ``active`` for as long as the LoRA backend takes to build,
    pack and fuse that set's stacks (it spreads the work over steps; see lora/backend.py): the steps
    timed next then measure the set's steady state, which a server runs nearly all its steps in."""
    if active:
        timed_step(engine, "decode", [ChunkSpec(1, 16, name) for name in active],
                   repeats=PACK_AFTER_STEPS + WARM_BUILD_STEPS)


def profile_steps(engine: Engine, count: int, adapters: list[str], seed: int = 0, repeats: int = 3,
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
    errors: dict[str, list[float]] = {"all": []}
    for step, sample in zip(steps[1::2], samples[1::2]):
        error = abs(sample_seconds(coefficients, sample) / sample.seconds - 1)
        errors["all"].append(error)
        errors.setdefault(step.kind, []).append(error)
    return Holdout(coefficients, errors)
